//! What every benchmark program reads the same way: its sizes from the environment, a
//! process's CPU time, and percentiles.

/// `key` as a number, or `default` when unset or not a number.
pub fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// CPU seconds (user + system) of a process, from `/proc/<pid>/stat` (clock ticks of 1/100 s,
/// the Linux default).
#[allow(dead_code)] // not every benchmark times a process
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at field 3.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(f64::NAN);
    // utime and stime are fields 14 and 15; `rest` starts at field 3.
    (ticks(11) + ticks(12)) / 100.0
}

/// The `p` quantile (nearest rank) of `sorted`; NaN when empty.
pub fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// CPU seconds by process name over one run (see [`CpuMeter`]).
#[allow(dead_code)] // not every benchmark times a set of processes
pub type CpuSpent = std::collections::BTreeMap<String, f64>;

/// CPU seconds spent by a set of processes from its start: one reading of each at `start`,
/// another at `spent`. A process gone at `start` (a one-shot job of the clusters) is left out.
#[allow(dead_code)] // not every benchmark times a set of processes
pub struct CpuMeter {
    start: Vec<(String, u32, f64)>,
}

#[allow(dead_code)]
impl CpuMeter {
    pub fn start(procs: &[(String, u32)]) -> Self {
        let start = procs.iter().map(|(name, pid)| (name.clone(), *pid, cpu_seconds(*pid)));
        CpuMeter { start: start.filter(|(_, _, cpu)| cpu.is_finite()).collect() }
    }

    /// Each process's CPU seconds since `start`, by name (same-named processes summed).
    pub fn spent(&self) -> CpuSpent {
        let mut out = CpuSpent::new();
        for (name, pid, c0) in &self.start {
            *out.entry(name.clone()).or_insert(0.0) += cpu_seconds(*pid) - c0;
        }
        out
    }
}
