//! `tp-train`: a small parameter-server training job for the real-node tests and the demo.
//!
//! `tp-train ps` serves one shard of a linear model's weights; `tp-train trainer` pulls the
//! weights from every PS, computes the gradient of real SGD on its own stream of synthetic
//! samples and pushes each PS its slice, logging `step=… loss=…` as it goes. Both stop on a
//! reclaim notice (the tidepool.io/reclaim-deadline line in /etc/tidepool/annotations) or on
//! SIGTERM (the member's own preemption, the fallback notice): they save their state to the
//! checkpoint store, write the ack to their termination message and exit; started again, they
//! resume from that checkpoint. Settings come from the environment (see `Config::from_env`).

mod checkpoint;
mod notice;
mod sgd;
mod store;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

use checkpoint::Checkpoint;
use store::Store;

#[derive(Debug, Clone)]
struct Config {
    index: usize,
    /// Parameter servers' `host:port`, in shard order (trainers dial them).
    ps: Vec<String>,
    ps_count: usize,
    port: u16,
    store: Option<Store>,
    dim: usize,
    batch: u64,
    lr: f64,
    /// A trainer stops (done) once the global step reaches this; 0: never.
    steps: u64,
    step_delay: Duration,
    seed: u64,
    log_every: u64,
    /// A PS also saves every this many pushes; 0: only when told to stop.
    checkpoint_every: u64,
    /// A PS under notice waits at most this long for its trainers to stop pushing.
    drain: Duration,
    annotations: String,
    termination_log: String,
}

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> Result<T, String> {
    match std::env::var(key) {
        Ok(v) if !v.is_empty() => v.parse().map_err(|_| format!("{key}={v:?} is not valid")),
        _ => Ok(default),
    }
}

impl Config {
    /// TP_INDEX (else JOB_COMPLETION_INDEX, else the number ending HOSTNAME), TP_PS
    /// (comma-separated host:port), TP_PS_COUNT, TP_PORT, TP_STORE (http://host:port/bucket/
    /// prefix), TP_DIM, TP_BATCH, TP_LR, TP_STEPS, TP_STEP_DELAY_MS, TP_SEED, TP_LOG_EVERY,
    /// TP_CHECKPOINT_EVERY, TP_DRAIN_SECONDS, TP_ANNOTATIONS, TP_TERMINATION_LOG.
    fn from_env() -> Result<Config, String> {
        let ps: Vec<String> = std::env::var("TP_PS")
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        let store = match std::env::var("TP_STORE") {
            Ok(url) if !url.is_empty() => Some(Store::parse(&url)?),
            _ => None,
        };
        Ok(Config {
            index: index_from_env()?,
            ps_count: env_or("TP_PS_COUNT", ps.len().max(2))?,
            ps,
            port: env_or("TP_PORT", 2222)?,
            store,
            dim: env_or("TP_DIM", 16)?,
            batch: env_or("TP_BATCH", 32)?,
            lr: env_or("TP_LR", 0.1)?,
            steps: env_or("TP_STEPS", 0)?,
            step_delay: Duration::from_millis(env_or("TP_STEP_DELAY_MS", 50)?),
            seed: env_or("TP_SEED", 1)?,
            log_every: env_or("TP_LOG_EVERY", 10u64)?.max(1),
            checkpoint_every: env_or("TP_CHECKPOINT_EVERY", 0)?,
            drain: Duration::from_secs(env_or("TP_DRAIN_SECONDS", 20)?),
            annotations: env_or("TP_ANNOTATIONS", "/etc/tidepool/annotations".to_owned())?,
            termination_log: env_or("TP_TERMINATION_LOG", "/dev/termination-log".to_owned())?,
        })
    }
}

fn index_from_env() -> Result<usize, String> {
    for key in ["TP_INDEX", "JOB_COMPLETION_INDEX"] {
        if let Ok(v) = std::env::var(key)
            && !v.is_empty()
        {
            return v.parse().map_err(|_| format!("{key}={v:?} is not an index"));
        }
    }
    let host = std::env::var("HOSTNAME").unwrap_or_default();
    host.rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("no TP_INDEX and HOSTNAME {host:?} does not end in -<index>"))
}

/// Why the process must stop now: the reclaim notice in its annotations, or SIGTERM.
#[derive(Debug, Clone)]
struct Stop {
    sigterm: Arc<AtomicBool>,
    annotations: String,
}

impl Stop {
    /// Registers the SIGTERM handler before returning, so no early signal is missed.
    fn watch(annotations: &str) -> Result<Stop, String> {
        let sigterm = Arc::new(AtomicBool::new(false));
        let rt = tokio::runtime::Builder::new_current_thread().enable_io().build().map_err(|e| e.to_string())?;
        let mut signal = rt
            .block_on(async { tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) })
            .map_err(|e| format!("SIGTERM handler: {e}"))?;
        let flag = sigterm.clone();
        thread::spawn(move || {
            rt.block_on(signal.recv());
            flag.store(true, Ordering::SeqCst);
        });
        Ok(Stop { sigterm, annotations: annotations.to_owned() })
    }

    fn reason(&self) -> Option<String> {
        if self.sigterm.load(Ordering::SeqCst) {
            return Some("SIGTERM".to_owned());
        }
        let text = std::fs::read_to_string(&self.annotations).ok()?;
        notice::deadline(&text).map(|d| format!("reclaim notice (deadline {d})"))
    }
}

fn say(role: &str, index: usize, msg: &str) {
    println!("{role} {index}: {msg}");
    let _ = std::io::stdout().flush();
}

/// Saves `c` under `key` (when a store is configured), then writes the ack.
fn save_and_ack(cfg: &Config, role: &str, key: &str, c: &Checkpoint) -> Result<(), String> {
    match &cfg.store {
        Some(store) => {
            store.ensure_bucket()?;
            store.put(key, checkpoint::encode(c).as_bytes())?;
            say(role, cfg.index, &format!("checkpoint saved: {key} step={} offset={}", c.step, c.offset));
        }
        None => say(role, cfg.index, "no TP_STORE: nothing to save"),
    }
    let ack = notice::ack_line(c.step, c.offset);
    match std::fs::write(&cfg.termination_log, &ack) {
        Ok(()) => say(role, cfg.index, &format!("ack: {}", ack.trim_end())),
        Err(e) => say(role, cfg.index, &format!("ack not written to {}: {e}", cfg.termination_log)),
    }
    Ok(())
}

fn load(cfg: &Config, role: &str, key: &str) -> Result<Option<Checkpoint>, String> {
    let Some(store) = &cfg.store else { return Ok(None) };
    match store.get(key)? {
        None => Ok(None),
        Some(bytes) => checkpoint::decode(&String::from_utf8_lossy(&bytes))
            .map(Some)
            .map_err(|e| format!("{role} checkpoint {key}: {e}")),
    }
}

// --- parameter server ---

#[derive(Debug)]
struct Shard {
    step: u64,
    weights: Vec<f64>,
}

fn run_ps(cfg: &Config, stop: &Stop) -> Result<Ended, String> {
    let key = format!("ps-{}", cfg.index);
    let range = sgd::shard(cfg.dim, cfg.ps_count, cfg.index);
    let resumed = load(cfg, "ps", &key)?;
    let shard = match &resumed {
        Some(c) if c.weights.len() == range.len() => Shard { step: c.step, weights: c.weights.clone() },
        Some(c) => return Err(format!("checkpoint {key} has {} weights, the shard {}", c.weights.len(), range.len())),
        None => Shard { step: 0, weights: vec![0.0; range.len()] },
    };
    let start = if resumed.is_some() { format!("resumed at step {}", shard.step) } else { "fresh".to_owned() };
    let listener = TcpListener::bind(("0.0.0.0", cfg.port)).map_err(|e| format!("listen :{}: {e}", cfg.port))?;
    say("ps", cfg.index, &format!("serving dims {range:?} on :{}, {start}", cfg.port));
    let shard = Arc::new(Mutex::new(shard));
    let serving = shard.clone();
    thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let shard = serving.clone();
            thread::spawn(move || serve(conn, &shard));
        }
    });
    let mut saved = 0;
    loop {
        if let Some(why) = stop.reason() {
            // The trainers got the notice too: the PS saves once they stopped pushing, so its
            // checkpoint holds every step they saved (a PS that left first would resume
            // behind its trainers). Bounded: a SIGTERM's grace is short.
            let limit = if why == "SIGTERM" { cfg.drain.min(Duration::from_secs(5)) } else { cfg.drain };
            let quiet = drain(&shard, DRAIN_QUIET, limit);
            let (step, weights) = snapshot(&shard);
            let drained = if quiet { "the trainers stopped" } else { "the trainers still push" };
            say("ps", cfg.index, &format!("{why}: {drained}; saving at step {step}"));
            return save_and_ack(cfg, "ps", &key, &Checkpoint { step, offset: 0, weights }).map(|()| Ended::Stopped);
        }
        let (step, weights) = snapshot(&shard);
        if cfg.checkpoint_every > 0 && step >= saved + cfg.checkpoint_every {
            if let Some(store) = &cfg.store {
                store.ensure_bucket()?;
                store.put(&key, checkpoint::encode(&Checkpoint { step, offset: 0, weights }).as_bytes())?;
            }
            saved = step;
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// A PS under notice waits until no push has come for this long.
const DRAIN_QUIET: Duration = Duration::from_secs(1);

/// Waits until the shard's step has not moved for `quiet`, or `limit` has passed; says which.
fn drain(shard: &Mutex<Shard>, quiet: Duration, limit: Duration) -> bool {
    let start = std::time::Instant::now();
    let (mut step, mut since) = (snapshot(shard).0, start);
    while start.elapsed() < limit {
        thread::sleep(Duration::from_millis(100));
        let now = snapshot(shard).0;
        if now != step {
            (step, since) = (now, std::time::Instant::now());
        } else if since.elapsed() >= quiet {
            return true;
        }
    }
    false
}

fn snapshot(shard: &Mutex<Shard>) -> (u64, Vec<f64>) {
    let s = shard.lock().unwrap_or_else(PoisonError::into_inner);
    (s.step, s.weights.clone())
}

/// One trainer's connection: `PULL` → `W <step> <w>…`; `PUSH <lr> <g>…` → `OK <step>`.
fn serve(conn: TcpStream, shard: &Mutex<Shard>) {
    let Ok(mut out) = conn.try_clone() else { return };
    for line in BufReader::new(conn).lines() {
        let Ok(line) = line else { return };
        let reply = answer(&line, shard);
        if out.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

fn answer(line: &str, shard: &Mutex<Shard>) -> String {
    let mut words = line.split_whitespace();
    let mut s = shard.lock().unwrap_or_else(PoisonError::into_inner);
    match words.next() {
        Some("PULL") => {
            let w: Vec<String> = s.weights.iter().map(f64::to_string).collect();
            format!("W {} {}\n", s.step, w.join(" "))
        }
        Some("PUSH") => {
            let numbers: Result<Vec<f64>, _> = words.map(str::parse::<f64>).collect();
            match numbers {
                Ok(n) if n.len() == s.weights.len() + 1 => {
                    sgd::apply(&mut s.weights, n[0], &n[1..]);
                    s.step += 1;
                    format!("OK {}\n", s.step)
                }
                _ => format!("ERR want PUSH <lr> and {} numbers\n", s.weights.len()),
            }
        }
        _ => "ERR unknown request\n".to_owned(),
    }
}

// --- trainer ---

#[derive(Debug)]
struct Link {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Link {
    fn call(&mut self, request: &str) -> Result<String, String> {
        self.writer.write_all(request.as_bytes()).map_err(|e| e.to_string())?;
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => Err("connection closed".to_owned()),
            Ok(_) => Ok(line),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// Dials every PS, retrying (their names may not resolve yet, they may be restarting) until
/// they all answer, the process is told to stop, or ten minutes have passed.
fn connect(cfg: &Config, stop: &Stop) -> Result<Option<Vec<Link>>, String> {
    let mut last = String::new();
    for attempt in 0..1200 {
        if stop.reason().is_some() {
            return Ok(None);
        }
        let links: Result<Vec<Link>, String> = cfg
            .ps
            .iter()
            .map(|addr| {
                let conn = dial(addr)?;
                conn.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
                let writer = conn.try_clone().map_err(|e| e.to_string())?;
                Ok(Link { reader: BufReader::new(conn), writer })
            })
            .collect();
        match links {
            Ok(l) => return Ok(Some(l)),
            Err(e) => {
                if attempt % 20 == 0 && e != last {
                    say("trainer", cfg.index, &format!("waiting for the parameter servers: {e}"));
                }
                last = e;
            }
        }
        thread::sleep(Duration::from_millis(500));
    }
    Err(format!("the parameter servers did not answer: {last}"))
}

/// Connects to `addr` within [`DIAL_TIMEOUT`]: a PS that died leaves its address behind for
/// a while (in DNS, in the neighbour table), and a plain connect to it waits minutes for an
/// answer, during which the trainer would not look at its notice.
fn dial(addr: &str) -> Result<TcpStream, String> {
    use std::net::ToSocketAddrs;
    let targets = addr.to_socket_addrs().map_err(|e| format!("{addr}: {e}"))?;
    let mut last = format!("{addr}: no address");
    for target in targets {
        match TcpStream::connect_timeout(&target, DIAL_TIMEOUT) {
            Ok(conn) => return Ok(conn),
            Err(e) => last = format!("{addr}: {e}"),
        }
    }
    Err(last)
}

/// How long a trainer waits for one PS to answer a connect.
const DIAL_TIMEOUT: Duration = Duration::from_secs(2);

/// One SGD step: pull every shard, compute the gradient on the next batch, push each PS its
/// slice. Returns the global step (PS 0's count) and the batch loss before the update.
fn train_step(cfg: &Config, links: &mut [Link], truth: &[f64], offset: u64) -> Result<(u64, f64), String> {
    let mut weights = Vec::with_capacity(cfg.dim);
    for link in links.iter_mut() {
        let reply = link.call("PULL\n")?;
        let mut words = reply.split_whitespace();
        if words.next() != Some("W") {
            return Err(format!("PULL answered {reply:?}"));
        }
        words.next();
        for w in words {
            weights.push(w.parse::<f64>().map_err(|e| format!("weight {w:?}: {e}"))?);
        }
    }
    if weights.len() != cfg.dim {
        return Err(format!("the parameter servers hold {} weights, want {}", weights.len(), cfg.dim));
    }
    let stream = cfg.index as u64;
    let batch: Vec<_> = (offset..offset + cfg.batch).map(|k| sgd::sample(cfg.seed, truth, stream, k)).collect();
    let (loss, grad) = sgd::loss_and_gradient(&weights, &batch);
    let mut step = 0;
    for (i, link) in links.iter_mut().enumerate() {
        let slice: Vec<String> = grad[sgd::shard(cfg.dim, cfg.ps_count, i)].iter().map(f64::to_string).collect();
        let reply = link.call(&format!("PUSH {} {}\n", cfg.lr, slice.join(" ")))?;
        let n = reply.strip_prefix("OK ").and_then(|s| s.trim().parse::<u64>().ok());
        let n = n.ok_or_else(|| format!("PUSH answered {reply:?}"))?;
        if i == 0 {
            step = n;
        }
    }
    Ok((step, loss))
}

fn run_trainer(cfg: &Config, stop: &Stop) -> Result<Ended, String> {
    if cfg.ps.is_empty() {
        return Err("a trainer needs TP_PS (the parameter servers' host:port, comma-separated)".to_owned());
    }
    let key = format!("trainer-{}", cfg.index);
    let truth = sgd::true_weights(cfg.seed, cfg.dim);
    let resumed = load(cfg, "trainer", &key)?;
    let (mut step, mut offset) = resumed.as_ref().map_or((0, 0), |c| (c.step, c.offset));
    let start = if resumed.is_some() { format!("resumed at step {step} offset {offset}") } else { "fresh".to_owned() };
    say("trainer", cfg.index, &format!("{start}; parameter servers {}", cfg.ps.join(",")));
    let mut links = None;
    let mut done = 0u64;
    loop {
        if let Some(why) = stop.reason() {
            say("trainer", cfg.index, &format!("{why}: saving at step {step} offset {offset}"));
            return save_and_ack(cfg, "trainer", &key, &Checkpoint { step, offset, weights: Vec::new() })
                .map(|()| Ended::Stopped);
        }
        if cfg.steps > 0 && step >= cfg.steps {
            say("trainer", cfg.index, &format!("done: step={step} offset={offset}"));
            return save_and_ack(cfg, "trainer", &key, &Checkpoint { step, offset, weights: Vec::new() })
                .map(|()| Ended::Done);
        }
        let Some(l) = links.as_mut() else {
            links = connect(cfg, stop)?;
            continue;
        };
        match train_step(cfg, l, &truth, offset) {
            Ok((s, loss)) => {
                step = s;
                offset += cfg.batch;
                done += 1;
                if done == 1 || done.is_multiple_of(cfg.log_every) {
                    say("trainer", cfg.index, &format!("step={step} loss={loss:.6} offset={offset}"));
                }
            }
            Err(e) => {
                say("trainer", cfg.index, &format!("lost the parameter servers ({e}): reconnecting"));
                links = None;
            }
        }
        thread::sleep(cfg.step_delay);
    }
}

/// How a role's run ended: its steps done, or stopped by the notice or SIGTERM with its
/// checkpoint saved and acked.
enum Ended {
    Done,
    Stopped,
}

/// The exit code after an ack: what tidepool puts in `TIDEPOOL_ACK_EXIT_CODE` for the pod's
/// restart policy (143, as a process SIGTERM ended, under `Never`: Kubeflow's `ExitCode`
/// policy restarts such a replica instead of failing the job; 0 under `OnFailure`, which
/// would restart a failed container in the member), 0 without it.
fn ack_exit_code() -> ExitCode {
    let code = std::env::var("TIDEPOOL_ACK_EXIT_CODE").ok().and_then(|v| v.trim().parse::<u8>().ok());
    ExitCode::from(code.unwrap_or(0))
}

fn main() -> ExitCode {
    let role = std::env::args().nth(1).or_else(|| std::env::var("TP_ROLE").ok()).unwrap_or_default();
    let result = Config::from_env().and_then(|cfg| {
        let stop = Stop::watch(&cfg.annotations)?;
        match role.as_str() {
            "ps" => run_ps(&cfg, &stop),
            "trainer" => run_trainer(&cfg, &stop),
            other => Err(format!("usage: tp-train ps|trainer (got {other:?}); settings in TP_* variables")),
        }
    });
    match result {
        Ok(Ended::Done) => ExitCode::SUCCESS,
        Ok(Ended::Stopped) => ack_exit_code(),
        Err(e) => {
            eprintln!("tp-train {role}: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ps_applies_pushes_and_counts_steps() {
        let shard = Mutex::new(Shard { step: 0, weights: vec![1.0, 2.0] });
        assert_eq!(answer("PULL", &shard), "W 0 1 2\n");
        assert_eq!(answer("PUSH 0.5 2 -2", &shard), "OK 1\n");
        assert_eq!(answer("PULL", &shard), "W 1 0 3\n");
        assert!(answer("PUSH 0.5 1", &shard).starts_with("ERR"));
        assert!(answer("PUSH x 1 2", &shard).starts_with("ERR"));
        assert!(answer("HELLO", &shard).starts_with("ERR"));
        assert_eq!(snapshot(&shard).0, 1);
    }

    #[test]
    fn a_ps_saves_once_its_trainers_stop_pushing_and_never_waits_past_its_limit() {
        let shard = Arc::new(Mutex::new(Shard { step: 0, weights: vec![0.0] }));
        // Nobody pushes: quiet.
        assert!(drain(&shard, Duration::from_millis(200), Duration::from_secs(30)));
        // A trainer that keeps pushing: the limit ends the wait, and says so.
        let stop = Arc::new(AtomicBool::new(false));
        let (pusher, flag) = (shard.clone(), stop.clone());
        let trainer = thread::spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                answer("PUSH 0.1 1", &pusher);
                thread::sleep(Duration::from_millis(20));
            }
        });
        assert!(!drain(&shard, Duration::from_millis(500), Duration::from_millis(800)));
        stop.store(true, Ordering::SeqCst);
        trainer.join().unwrap();
        assert!(snapshot(&shard).0 > 0);
    }
}
