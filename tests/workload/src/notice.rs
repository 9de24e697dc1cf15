//! The reclaim notice as the process sees it: tidepool's copy of the pod projects its
//! annotations into `/etc/tidepool/annotations` (downward API: one `key="value"` line each,
//! the value quoted as Go quotes strings), and the notice is the reclaim-deadline line.

/// Annotation tidepool writes when it reclaims the pod: the deadline, RFC 3339.
pub const RECLAIM_DEADLINE: &str = "tidepool.io/reclaim-deadline";
/// What the process writes to its termination message once its checkpoint is stored: the
/// member's kubelet reports it, tidepool reads the container's exit under a notice as the ack.
pub const ACK_PREFIX: &str = "tidepool.io/checkpointed";

/// The deadline of the reclaim notice in an annotations file's text, if there is one.
pub fn deadline(annotations: &str) -> Option<String> {
    annotations.lines().find_map(|line| {
        let (key, value) = line.split_once('=')?;
        (key == RECLAIM_DEADLINE).then(|| unquote(value))
    })
}

/// The line a process writes to its termination message after its checkpoint.
pub fn ack_line(step: u64, offset: u64) -> String {
    format!("{ACK_PREFIX} step={step} offset={offset}\n")
}

fn unquote(value: &str) -> String {
    let inner = value.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(value);
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some(other) => out.push(other),
                None => {}
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_is_read_from_the_projected_file() {
        let file = "kubernetes.io/config.seen=\"2026-12-01T12:00:00Z\"\n\
                    tidepool.io/origin-name=\"trainer-0\"\n\
                    tidepool.io/reclaim-deadline=\"2026-12-01T12:01:00Z\"\n";
        assert_eq!(deadline(file).as_deref(), Some("2026-12-01T12:01:00Z"));
    }

    #[test]
    fn no_notice_without_the_deadline_line() {
        assert_eq!(deadline(""), None);
        assert_eq!(deadline("tidepool.io/origin-name=\"x\"\n"), None);
        // Another key that merely contains the name is not the notice.
        assert_eq!(deadline("x.tidepool.io/reclaim-deadline=\"soon\"\n"), None);
        assert_eq!(deadline("tidepool.io/reclaim-deadline-note=\"soon\"\n"), None);
    }

    #[test]
    fn quoted_values_are_unescaped() {
        assert_eq!(unquote(r#""a\"b\\c""#), "a\"b\\c");
        assert_eq!(unquote("bare"), "bare");
    }

    #[test]
    fn the_ack_names_the_step_and_offset() {
        assert_eq!(ack_line(12, 384), "tidepool.io/checkpointed step=12 offset=384\n");
    }
}
