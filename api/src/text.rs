//! Text that came from somewhere tidepool does not trust (a member's API server, its
//! kubelets, a tenant) on its way to where people read it: a terminal (`kubectl describe`,
//! `kubectl tidepool why`), a log, a pod's status. Control characters are shown, not obeyed
//! (an escape sequence in an Event message would otherwise move a reader's cursor, clear the
//! screen or retitle the terminal), and the length is bounded.

/// `text` with every control character (C0, DEL, C1) written as Rust writes it in a string
/// literal (`\n`, `\u{1b}`), cut to at most `max_bytes` bytes at a character boundary; a text
/// that was cut ends with `…` (within the bound).
pub fn shown(text: &str, max_bytes: usize) -> String {
    const MORE: &str = "…";
    let mut out = String::with_capacity(text.len().min(max_bytes));
    // Where each character (or its escape) ends in `out`: a cut falls only there.
    let mut ends = Vec::new();
    for c in text.chars() {
        let piece: String = if c.is_control() { c.escape_default().collect() } else { c.to_string() };
        if out.len() + piece.len() > max_bytes {
            let room = max_bytes.saturating_sub(MORE.len());
            let keep = ends.iter().rev().copied().find(|&end| end <= room).unwrap_or(0);
            out.truncate(keep);
            if max_bytes >= MORE.len() {
                out.push_str(MORE);
            }
            return out;
        }
        out.push_str(&piece);
        ends.push(out.len());
    }
    out
}

/// `text` cut to at most `max_bytes` bytes at a character boundary (control characters kept:
/// for fields that are data, like a container's termination message, which a trainer's ack
/// is read from).
pub fn cut(text: &str, max_bytes: usize) -> &str {
    if text.len() <= max_bytes {
        return text;
    }
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn control_characters_are_shown_not_obeyed() {
        assert_eq!(shown("ok\x1b]0;pwned\x07\x1b[2J\n", 100), "ok\\u{1b}]0;pwned\\u{7}\\u{1b}[2J\\n");
        assert_eq!(shown("C1 \u{9b}31m", 100), "C1 \\u{9b}31m");
        assert_eq!(shown("plain, ünïcode", 100), "plain, ünïcode");
    }

    #[test]
    fn long_text_is_cut_with_a_mark() {
        assert_eq!(shown("abcdef", 6), "abcdef");
        assert_eq!(shown("abcdefg", 6), "abc…");
        assert_eq!(shown("\n\n\n", 5), "\\n…");
        assert_eq!(shown("a\x1bbcd", 9), "a…", "an escape is never cut in half");
        assert_eq!(cut("ab€", 4), "ab");
        assert_eq!(cut("ab€", 5), "ab€");
    }

    proptest! {
        #[test]
        fn the_bound_holds_and_nothing_is_a_control_character(s in "(?s).{0,200}", max in 0usize..120) {
            let out = shown(&s, max);
            prop_assert!(out.len() <= max);
            prop_assert!(!out.chars().any(char::is_control));
            let c = cut(&s, max);
            prop_assert!(c.len() <= max && s.starts_with(c));
        }
    }
}
