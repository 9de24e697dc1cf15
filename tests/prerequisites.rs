//! Keeps `deploy/prerequisites` complete: every external command a script under `tests/`,
//! `deploy/` or `.ci/` runs (and every program the e2e tests spawn by name) must be one the
//! prerequisites step provides, so a fresh machine never discovers a missing tool after a long
//! build. `cargo test --test prerequisites` (tests/run.sh runs it before building anything).
//!
//! The scripts are read with a small shell lexer that knows where bash expects a command:
//! the start of a line or of a pipeline element, after `;`, `&&`, `||`, `(`, `$(`, a
//! backquote, `<(`, and after `then`, `do`, `else`, `if`, `while`, `until`, `!`; after
//! assignments and after the prefixes that run their argument (`exec`, `command`, `setsid`,
//! `nice`, `timeout`, `env`, `xargs`, ...). Heredoc bodies, comments, case patterns, `[[ ]]`
//! and `(( ))` are not commands; neither is anything named through a variable or a path
//! (the binaries the scripts build themselves).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Bash builtins and keywords: never looked up on PATH.
const BUILTINS: &[&str] = &[
    ".",
    ":",
    "[",
    "alias",
    "bg",
    "bind",
    "break",
    "builtin",
    "caller",
    "cd",
    "command",
    "compgen",
    "complete",
    "continue",
    "declare",
    "dirs",
    "disown",
    "echo",
    "enable",
    "eval",
    "exec",
    "exit",
    "export",
    "false",
    "fc",
    "fg",
    "getopts",
    "hash",
    "help",
    "history",
    "jobs",
    "kill",
    "let",
    "local",
    "logout",
    "mapfile",
    "popd",
    "printf",
    "pushd",
    "pwd",
    "read",
    "readarray",
    "readonly",
    "return",
    "set",
    "shift",
    "shopt",
    "source",
    "suspend",
    "test",
    "times",
    "trap",
    "true",
    "type",
    "typeset",
    "ulimit",
    "umask",
    "unalias",
    "unset",
    "wait",
];

/// Commands that run their argument as a command: how many words (after their options) come
/// before it, and which of their options take a value.
const PREFIXES: &[(&str, usize, &[&str])] = &[
    ("exec", 0, &[]),
    ("command", 0, &[]),
    ("builtin", 0, &[]),
    ("setsid", 0, &[]),
    ("nohup", 0, &[]),
    ("time", 0, &[]),
    ("nice", 0, &["-n"]),
    ("timeout", 1, &["-s", "-k"]),
    ("env", 0, &["-u", "-C"]),
    ("xargs", 0, &["-n", "-I", "-P", "-d", "-L", "-s"]),
    ("nsenter", 0, &["-t", "--net", "-n"]),
    // The scripts' own wrappers: `start NAME CMD ...` (tests/controlplane/cluster.sh).
    ("start", 1, &[]),
];

/// One command found in a script: where, and its name as written.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Use {
    line: usize,
    name: String,
}

/// What a script runs and defines.
#[derive(Debug, Default)]
struct Scan {
    commands: Vec<Use>,
    functions: BTreeSet<String>,
    python_modules: Vec<Use>,
}

struct Lexer<'a> {
    s: &'a [char],
    i: usize,
    line: usize,
    out: Scan,
}

/// Removes heredoc bodies (they are data or another program's source) but keeps their lines,
/// so line numbers stay right.
fn without_heredocs(text: &str) -> String {
    let mut out = String::new();
    let mut until: Option<String> = None;
    for line in text.lines() {
        if let Some(end) = &until {
            if line.trim() == end {
                until = None;
            }
            out.push('\n');
            continue;
        }
        until = heredoc_terminator(line);
        out.push_str(line);
        out.push('\n');
    }
    out
}

fn heredoc_terminator(line: &str) -> Option<String> {
    let at = line.find("<<")?;
    let rest = &line[at + 2..];
    if rest.starts_with('<') || line[..at].ends_with('<') || line[..at].contains('#') {
        return None;
    }
    let rest = rest.trim_start_matches('-').trim_start();
    let word: String =
        rest.trim_start_matches(['\'', '"']).chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
    (!word.is_empty()).then_some(word)
}

fn is_assignment(word: &str) -> bool {
    let Some(eq) = word.find('=') else { return false };
    let name = word[..eq].trim_end_matches('+');
    let name = name.split('[').next().unwrap_or(name);
    !name.is_empty()
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit())
}

impl<'a> Lexer<'a> {
    fn peek(&self, k: usize) -> Option<char> {
        self.s.get(self.i + k).copied()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.s.get(self.i).copied()?;
        self.i += 1;
        if c == '\n' {
            self.line += 1;
        }
        Some(c)
    }

    fn skip_blanks(&mut self) {
        while let Some(c) = self.peek(0) {
            match c {
                ' ' | '\t' => {
                    self.bump();
                }
                '\\' if self.peek(1) == Some('\n') => {
                    self.bump();
                    self.bump();
                }
                _ => break,
            }
        }
    }

    fn skip_comment(&mut self) {
        while let Some(c) = self.peek(0) {
            if c == '\n' {
                break;
            }
            self.bump();
        }
    }

    /// Skips to the end of a balanced `open`…`close` span (the opener already consumed).
    fn skip_balanced(&mut self, open: char, close: char) {
        let mut depth = 1;
        while let Some(c) = self.bump() {
            if c == open {
                depth += 1;
            } else if c == close {
                depth -= 1;
                if depth == 0 {
                    return;
                }
            }
        }
    }

    /// Reads one word, scanning the command substitutions inside it. Returns it with its quotes
    /// removed and whether it is literal (no expansion in it).
    fn word(&mut self) -> (String, bool) {
        let mut w = String::new();
        let mut literal = true;
        while let Some(c) = self.peek(0) {
            match c {
                ' ' | '\t' | '\n' | ';' | '&' | '|' | '<' | '>' | ')' => break,
                '(' if w.ends_with('=') => {
                    // `name=(…)`: an array's words, not a subshell.
                    self.bump();
                    self.skip_balanced('(', ')');
                    w.push_str("()");
                }
                '(' if w.is_empty() || !w.ends_with(['@', '?', '*', '+', '!']) => break,
                '\\' => {
                    self.bump();
                    if let Some(n) = self.bump() {
                        w.push(n);
                    }
                }
                '\'' => {
                    self.bump();
                    while let Some(n) = self.bump() {
                        if n == '\'' {
                            break;
                        }
                        w.push(n);
                    }
                }
                '"' => {
                    self.bump();
                    self.double_quoted(&mut w, &mut literal);
                }
                '$' | '`' => {
                    literal = false;
                    self.expansion();
                    w.push('$');
                }
                _ => {
                    self.bump();
                    w.push(c);
                }
            }
        }
        (w, literal)
    }

    fn double_quoted(&mut self, w: &mut String, literal: &mut bool) {
        while let Some(c) = self.peek(0) {
            match c {
                '"' => {
                    self.bump();
                    return;
                }
                '\\' => {
                    self.bump();
                    if let Some(n) = self.bump() {
                        w.push(n);
                    }
                }
                '$' | '`' => {
                    *literal = false;
                    self.expansion();
                    w.push('$');
                }
                _ => {
                    self.bump();
                    w.push(c);
                }
            }
        }
    }

    /// `$(…)` and backquotes are command lists; `$((…))`, `${…}` and `$name` are not.
    fn expansion(&mut self) {
        if self.bump() == Some('`') {
            self.list(Some('`'));
            return;
        }
        match (self.peek(0), self.peek(1)) {
            (Some('('), Some('(')) => {
                self.bump();
                self.bump();
                self.skip_balanced('(', ')');
                self.bump();
            }
            (Some('('), _) => {
                self.bump();
                self.list(Some(')'));
            }
            (Some('{'), _) => {
                self.bump();
                self.skip_balanced('{', '}');
            }
            (Some(c), _) if c.is_ascii_alphanumeric() || c == '_' => {
                while self.peek(0).is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                    self.bump();
                }
            }
            (Some(c), _) if "#?@*!$-".contains(c) => {
                self.bump();
            }
            _ => {}
        }
    }

    /// A redirection: `<`, `>`, `>>`, `>&`, `<&`, `&>`, `<<<`, or a process substitution.
    fn redirection(&mut self) {
        let first = self.bump();
        if matches!(self.peek(0), Some('(')) {
            self.bump();
            self.list(Some(')'));
            return;
        }
        while matches!(self.peek(0), Some('>' | '<' | '&')) {
            self.bump();
        }
        if first == Some('<') && self.peek(0) == Some('-') {
            self.bump();
        }
        self.skip_blanks();
        let _target = self.word();
    }

    /// A case clause's patterns, up to their `)`.
    fn case_patterns(&mut self) {
        while let Some(c) = self.bump() {
            match c {
                '\'' => self.skip_to('\''),
                '"' => self.skip_to('"'),
                ')' => return,
                _ => {}
            }
        }
    }

    fn skip_to(&mut self, end: char) {
        while let Some(c) = self.bump() {
            if c == end {
                return;
            }
        }
    }

    /// A command list, up to `end` (a closing paren or backquote) or the end of the text.
    fn list(&mut self, end: Option<char>) {
        let mut at_cmd = true;
        let mut prefix: Option<(usize, &'static [&'static str])> = None;
        let mut cases: Vec<bool> = Vec::new(); // per open `case`: expecting a pattern
        let mut skip_simple = false; // the words of `for`/`select`/`case … in`
        loop {
            self.skip_blanks();
            let Some(c) = self.peek(0) else { return };
            if Some(c) == end {
                self.bump();
                return;
            }
            if c == '#' {
                self.skip_comment();
                continue;
            }
            if cases.last() == Some(&true) && !matches!(c, '\n' | ';') {
                if self.looking_at_word("esac") {
                    self.word();
                    cases.pop();
                    at_cmd = false;
                } else {
                    self.case_patterns();
                    if let Some(last) = cases.last_mut() {
                        *last = false;
                    }
                    at_cmd = true;
                }
                continue;
            }
            match c {
                '#' => self.skip_comment(),
                '\n' | ';' => {
                    self.bump();
                    if c == ';' && self.peek(0) == Some(';') {
                        self.bump();
                        if self.peek(0) == Some('&') {
                            self.bump();
                        }
                        if let Some(last) = cases.last_mut() {
                            *last = true;
                        }
                    } else if c == ';' && self.peek(0) == Some('&') {
                        self.bump();
                        if let Some(last) = cases.last_mut() {
                            *last = true;
                        }
                    }
                    at_cmd = true;
                    prefix = None;
                    skip_simple = false;
                }
                '&' | '|' => {
                    self.bump();
                    if c == '&' && self.peek(0) == Some('>') {
                        self.redirection();
                        continue;
                    }
                    if matches!(self.peek(0), Some('&' | '|')) {
                        self.bump();
                    }
                    at_cmd = true;
                    prefix = None;
                    skip_simple = false;
                }
                '(' => {
                    self.bump();
                    if self.peek(0) == Some('(') {
                        self.bump();
                        self.skip_balanced('(', ')');
                        self.bump();
                        at_cmd = false;
                    } else {
                        self.list(Some(')'));
                        at_cmd = false;
                    }
                }
                ')' => {
                    self.bump();
                    at_cmd = false;
                }
                '<' | '>' => self.redirection(),
                _ => {
                    let start = self.i;
                    let line = self.line;
                    let (w, literal) = self.word();
                    if self.i == start {
                        self.bump();
                        continue;
                    }
                    if w.chars().all(|d| d.is_ascii_digit()) && matches!(self.peek(0), Some('<' | '>')) {
                        self.redirection();
                        continue;
                    }
                    if skip_simple {
                        if w == "in" && cases.last() == Some(&false) && literal {
                            // `case WORD in`: the clauses follow.
                            if let Some(last) = cases.last_mut() {
                                *last = true;
                            }
                            skip_simple = false;
                        }
                        continue;
                    }
                    if !at_cmd {
                        continue;
                    }
                    self.command_word(&w, literal, line, &mut at_cmd, &mut prefix, &mut cases, &mut skip_simple);
                }
            }
        }
    }

    fn looking_at_word(&self, word: &str) -> bool {
        let n = word.chars().count();
        self.s[self.i..].iter().take(n).copied().eq(word.chars())
            && self.peek(n).is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
    }

    #[allow(clippy::too_many_arguments)]
    fn command_word(
        &mut self,
        w: &str,
        literal: bool,
        line: usize,
        at_cmd: &mut bool,
        prefix: &mut Option<(usize, &'static [&'static str])>,
        cases: &mut Vec<bool>,
        skip_simple: &mut bool,
    ) {
        // Inside a prefix command: its options, then its fixed arguments, then the command.
        if let Some((before, value_opts)) = *prefix {
            if w.starts_with('-') && w.len() > 1 {
                if value_opts.contains(&w) {
                    self.skip_blanks();
                    self.word();
                }
                return;
            }
            if before > 0 {
                *prefix = Some((before - 1, value_opts));
                return;
            }
            if is_assignment(w) {
                return;
            }
            *prefix = None;
        } else if is_assignment(w) {
            return;
        }
        if literal {
            match w {
                "if" | "then" | "else" | "elif" | "do" | "while" | "until" | "!" | "{" => return,
                "fi" | "done" | "}" | "esac" => {
                    *at_cmd = false;
                    return;
                }
                "for" | "select" => {
                    *skip_simple = true;
                    return;
                }
                "case" => {
                    cases.push(false);
                    *skip_simple = true;
                    return;
                }
                "[[" => {
                    self.skip_test_expression();
                    *at_cmd = false;
                    return;
                }
                "function" => {
                    self.skip_blanks();
                    let (name, _) = self.word();
                    self.out.functions.insert(name);
                    return;
                }
                _ => {}
            }
        }
        // `name() {`: a function definition, not a call.
        self.skip_blanks();
        if self.peek(0) == Some('(') && self.peek(1) == Some(')') {
            self.bump();
            self.bump();
            self.out.functions.insert(w.to_string());
            return;
        }
        *at_cmd = false;
        // Named through a variable, or a path: the scripts' own builds, not a machine's tool.
        if !literal || w.contains('/') {
            return;
        }
        self.out.commands.push(Use { line, name: w.to_string() });
        if w == "command" || w == "type" || w == "hash" {
            self.named_by_check(line);
        }
        if w == "python3" {
            self.python_module(line);
        }
        if let Some((_, before, opts)) = PREFIXES.iter().find(|(p, ..)| *p == w) {
            *prefix = Some((*before, opts));
            *at_cmd = true;
        }
    }

    /// `command -v NAME`: the script needs NAME.
    fn named_by_check(&mut self, line: usize) {
        let save = (self.i, self.line);
        self.skip_blanks();
        let (flag, _) = self.word();
        if flag == "-v" || flag == "-V" {
            self.skip_blanks();
            let (name, literal) = self.word();
            if literal && !name.is_empty() {
                self.out.commands.push(Use { line, name });
            }
            return;
        }
        (self.i, self.line) = save;
    }

    /// `python3 -m MODULE`: the script needs MODULE.
    fn python_module(&mut self, line: usize) {
        let save = (self.i, self.line);
        self.skip_blanks();
        let (flag, _) = self.word();
        if flag == "-m" {
            self.skip_blanks();
            let (module, literal) = self.word();
            if literal && module != "pip" {
                self.out.python_modules.push(Use { line, name: module });
            }
        }
        (self.i, self.line) = save;
    }

    fn skip_test_expression(&mut self) {
        loop {
            self.skip_blanks();
            if self.peek(0).is_none() {
                return;
            }
            if self.looking_at_word("]]") {
                self.bump();
                self.bump();
                return;
            }
            let start = self.i;
            self.word();
            if self.i == start {
                self.bump();
            }
        }
    }
}

fn scan(script: &str) -> Scan {
    let text: Vec<char> = without_heredocs(script).chars().collect();
    let mut lx = Lexer { s: &text, i: 0, line: 1, out: Scan::default() };
    while lx.peek(0).is_some() {
        lx.list(None);
        lx.bump();
    }
    lx.out
}

/// What `deploy/prerequisites` provides: command names and Python modules.
#[derive(Debug, Default)]
struct Provided {
    commands: BTreeSet<String>,
    python_modules: BTreeSet<String>,
}

fn provided(list: &str) -> Result<Provided, String> {
    let mut p = Provided::default();
    for (n, line) in list.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut cols = line.split_whitespace();
        let (Some(check), Some(source), Some(_why)) = (cols.next(), cols.next(), cols.next()) else {
            return Err(format!("line {}: want `check source why`: {line}", n + 1));
        };
        let known_source = ["debian:", "pypi:", "toolchain:"].iter().any(|s| source.starts_with(s));
        if !known_source {
            return Err(format!("line {}: unknown source {source}", n + 1));
        }
        match check.split_once(':') {
            Some(("cmd", name)) => {
                p.commands.insert(name.to_string());
            }
            Some(("py", module)) => {
                p.python_modules.insert(module.to_string());
            }
            Some(("file" | "static", path)) => {
                if let Some(base) = Path::new(path).file_name() {
                    p.commands.insert(base.to_string_lossy().into_owned());
                }
            }
            _ => return Err(format!("line {}: unknown check {check}", n + 1)),
        }
    }
    Ok(p)
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The repository's shell scripts (by extension or shebang) under tests/, deploy/ and .ci/.
fn scripts() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in ["tests", "deploy", ".ci"] {
        walk(&repo().join(dir), &mut |p| {
            let text = std::fs::read_to_string(p).unwrap_or_default();
            let shell = p.extension().is_some_and(|e| e == "sh")
                || text.starts_with("#!/usr/bin/env bash")
                || text.starts_with("#!/bin/bash")
                || text.starts_with("#!/bin/sh");
            if shell {
                out.push(p.to_path_buf());
            }
        });
    }
    out.sort();
    out
}

fn rust_sources() -> Vec<PathBuf> {
    let mut out = Vec::new();
    walk(&repo().join("tests"), &mut |p| {
        if p.extension().is_some_and(|e| e == "rs") && !p.ends_with("prerequisites.rs") {
            out.push(p.to_path_buf());
        }
    });
    out
}

fn walk(dir: &Path, f: &mut dyn FnMut(&Path)) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if !p.ends_with("target") {
                walk(&p, f);
            }
        } else {
            f(&p);
        }
    }
}

/// Programs the e2e tests and benchmarks spawn by a literal name.
fn spawned_by_name(source: &str) -> Vec<Use> {
    let mut out = Vec::new();
    for (n, line) in source.lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find("Command::new(\"") {
            rest = &rest[at + "Command::new(\"".len()..];
            if let Some(end) = rest.find('"') {
                out.push(Use { line: n + 1, name: rest[..end].to_string() });
            }
        }
    }
    out
}

fn relative(p: &Path) -> String {
    p.strip_prefix(repo()).unwrap_or(p).display().to_string()
}

#[test]
fn every_command_the_scripts_run_is_a_prerequisite() {
    let list = std::fs::read_to_string(repo().join("deploy/prerequisites")).unwrap();
    let have = provided(&list).unwrap();
    let scans: BTreeMap<String, Scan> =
        scripts().iter().map(|p| (relative(p), scan(&std::fs::read_to_string(p).unwrap()))).collect();
    assert!(scans.len() >= 10, "found only {} scripts: {:?}", scans.len(), scans.keys());
    // Scripts source each other: a function of any of them is no external command.
    let functions: BTreeSet<&str> = scans.values().flat_map(|s| s.functions.iter().map(String::as_str)).collect();
    let mut missing = Vec::new();
    for (file, s) in &scans {
        for u in &s.commands {
            let external = !BUILTINS.contains(&u.name.as_str()) && !functions.contains(u.name.as_str());
            if external && !have.commands.contains(&u.name) {
                missing.push(format!("{file}:{} runs `{}`", u.line, u.name));
            }
        }
        for u in &s.python_modules {
            if !have.python_modules.iter().any(|m| m == &u.name || m.starts_with(&format!("{}.", u.name))) {
                missing.push(format!("{file}:{} runs python3 -m {}", u.line, u.name));
            }
        }
    }
    for p in rust_sources() {
        for u in spawned_by_name(&std::fs::read_to_string(&p).unwrap()) {
            if !have.commands.contains(&u.name) {
                missing.push(format!("{}:{} spawns `{}`", relative(&p), u.line, u.name));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "commands that deploy/prerequisites does not provide (add a line for each, with the \
         package that has it):\n  {}",
        missing.join("\n  ")
    );
}

#[test]
fn the_list_parses_and_names_the_tools_a_fresh_machine_lacks() {
    let list = std::fs::read_to_string(repo().join("deploy/prerequisites")).unwrap();
    let have = provided(&list).unwrap();
    // The tools a fresh machine of this kind was seen without (issue "Fresh machine"); runc
    // is built now (tests/nodes/build.sh), from libseccomp's headers and pkg-config.
    for tool in ["socat", "jq", "umoci", "busybox", "pkg-config"] {
        assert!(have.commands.contains(tool), "{tool} is not on the list");
    }
    assert!(list.lines().any(|l| l.starts_with("file:/usr/include/seccomp.h ")), "libseccomp-dev is not on the list");
    assert!(have.python_modules.contains("moto.server"));
    assert!(provided("cmd:x nowhere:y why").is_err(), "an unknown source is an error");
    assert!(provided("bin:x debian:y why").is_err(), "an unknown check is an error");
}

fn names(script: &str) -> Vec<String> {
    scan(script).commands.into_iter().map(|u| u.name).collect()
}

#[test]
fn the_lexer_finds_commands_where_bash_runs_them() {
    let cases: &[(&str, &str, &[&str])] = &[
        ("a pipeline's every element", "cat f | sort -u | head -n 1\n", &["cat", "sort", "head"]),
        ("after assignments", "A=1 B=\"x y\" jq -r . f\n", &["jq"]),
        (
            "inside command substitutions, quoted or not",
            "x=$(date +%s) y=\"$(sha256sum f | cut -c1-8)\"\n",
            &["date", "sha256sum", "cut"],
        ),
        ("nested substitutions", "echo \"$(basename \"$(dirname x)\")\"\n", &["echo", "basename", "dirname"]),
        (
            "after && || ; and keywords",
            "if grep -q x f; then sed -i y f || awk 1 f; fi && tar c\n",
            &["grep", "sed", "awk", "tar"],
        ),
        ("a process substitution", "while read -r l; do :; done < <(find . -name x)\n", &["read", ":", "find"]),
        (
            "what a prefix runs",
            "exec setsid nice -n 19 timeout 5 socat a b\n",
            &["exec", "setsid", "nice", "timeout", "socat"],
        ),
        ("the scripts' own start wrapper", "start \"$c-relay\" socat -lf x\n", &["start", "socat"]),
        ("a checked command", "command -v umoci >/dev/null || exit 1\n", &["command", "umoci", "exit"]),
        ("not a heredoc's body", "cat <<EOF >f\nopenssl x\nEOF\nls\n", &["cat", "ls"]),
        ("not a quoted heredoc's body", "cat <<'EOF'\nrm -rf /\nEOF\n", &["cat"]),
        ("not comments", "# curl x\nls # wget y\n", &["ls"]),
        ("not case patterns", "case $x in\n  up|down) ip link ;;\n  *) usage ;;\nesac\n", &["ip", "usage"]),
        ("not the words of [[ ]] or (( ))", "[[ -x f ]] && ((n++)) && make\n", &["make"]),
        ("a substitution inside [[ ]]", "[[ -n $(command -v go) ]]\n", &["command", "go"]),
        ("not a loop's words", "for b in etcd kwok; do cp $b x; done\n", &["cp"]),
        ("not through a variable or path", "\"$CP_BIN/kubectl\" get x; ./run.sh; $py -c x\n", &[]),
        ("a redirection before the command", "2>/dev/null curl -fs x\n", &["curl"]),
        ("a subshell", "(cd d && go build .) 2>&1 | progress x\n", &["cd", "go", "progress"]),
        ("continued lines", "curl -fs \\\n  --max-time 2 x \\\n  | jq .\n", &["curl", "jq"]),
    ];
    for (what, script, want) in cases {
        assert_eq!(names(script), *want, "{what}: {script}");
    }
}

#[test]
#[ignore = "a debugging aid: TP_SCAN=FILE cargo test --test prerequisites -- --ignored --nocapture"]
fn print_a_scan() {
    let file = std::env::var("TP_SCAN").unwrap();
    let s = scan(&std::fs::read_to_string(file).unwrap());
    for u in s.commands {
        println!("{:5} {}", u.line, u.name);
    }
}

#[test]
fn the_lexer_knows_functions_and_python_modules() {
    let s = scan("log() { printf x; }\nfunction fail { exit 1; }\npython3 -m moto.server -H x\n");
    assert_eq!(s.functions, ["fail", "log"].iter().map(|f| f.to_string()).collect());
    assert_eq!(s.python_modules.iter().map(|u| u.name.as_str()).collect::<Vec<_>>(), ["moto.server"]);
}

#[test]
fn spawned_programs_are_read_from_rust() {
    let src = "let a = std::process::Command::new(\"curl\");\nlet b = Command::new(env.var(\"X\"));\n";
    assert_eq!(spawned_by_name(src), vec![Use { line: 1, name: "curl".into() }]);
}
