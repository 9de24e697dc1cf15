//! Five-field cron schedules (`minute hour day-of-month month day-of-week`) for capacity
//! reservation windows, read as Kubernetes CronJobs read them: `*`, lists, ranges and steps,
//! month and weekday names (`JAN`, `mon-fri`), `?` for `*` in the day fields, the macros
//! `@yearly`/`@annually`, `@monthly`, `@weekly`, `@daily`/`@midnight`, `@hourly`; day-of-week
//! 0 or 7 is Sunday. The day rule is CronJob's: when both day fields are restricted either
//! may match, and a day field that starts with `*` (so `*/2` too) is not restricted — the
//! two then must both match.
//!
//! A schedule is read in a time zone (IANA name, as CronJob's `timeZone`; UTC by default),
//! minute by minute of real time: on a spring-forward day the skipped local times never come,
//! so a schedule firing only inside the gap does not fire that day; on a fall-back day the
//! repeated local hour comes twice, and so does a firing inside it.

#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    minutes: u64,
    hours: u64,
    days: u64,
    months: u64,
    weekdays: u64,
    days_restricted: bool,
    weekdays_restricted: bool,
    tz: jiff::tz::TimeZone,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid cron schedule {schedule:?}: {reason}")]
pub struct CronError {
    pub schedule: String,
    pub reason: String,
}

const MONTHS: [&str; 12] = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"];
const WEEKDAYS: [&str; 7] = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"];

/// A value of a field: a number, or a name of `names` (case-insensitive, numbered from `lo`).
fn value(text: &str, lo: u32, names: &[&str], name: &str) -> Result<u32, String> {
    if let Ok(v) = text.parse() {
        return Ok(v);
    }
    let lower = text.to_ascii_lowercase();
    names.iter().position(|n| *n == lower).map(|i| lo + i as u32).ok_or_else(|| format!("bad {name} {text:?}"))
}

/// The bits of one field, and whether it restricts (for the day rule: not when it starts
/// with `*` or is `?`).
fn field(spec: &str, lo: u32, hi: u32, name: &str, names: &[&str]) -> Result<(u64, bool), String> {
    let mut bits = 0u64;
    for part in spec.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((r, s)) => (r, s.parse::<u32>().map_err(|_| format!("bad step in {name} field {part:?}"))?),
            None => (part, 1),
        };
        if step == 0 {
            return Err(format!("step 0 in {name} field"));
        }
        let (a, b) = if range == "*" || range == "?" {
            (lo, hi)
        } else if let Some((a, b)) = range.split_once('-') {
            (value(a, lo, names, name)?, value(b, lo, names, name)?)
        } else {
            let a = value(range, lo, names, name)?;
            (a, if part.contains('/') { hi } else { a })
        };
        if a < lo || b > hi || a > b {
            return Err(format!("{name} {a}-{b} outside {lo}-{hi}"));
        }
        // Checked: a step as large as u32 allows would overflow past `b` (and panic in
        // debug builds) instead of ending the range.
        let mut v = Some(a);
        while let Some(x) = v.filter(|x| *x <= b) {
            bits |= 1 << x;
            v = x.checked_add(step);
        }
    }
    Ok((bits, !(spec.starts_with('*') || spec == "?")))
}

/// The five fields a macro stands for.
fn expand(s: &str) -> Result<&str, String> {
    Ok(match s.trim().to_ascii_lowercase().as_str() {
        "@yearly" | "@annually" => "0 0 1 1 *",
        "@monthly" => "0 0 1 * *",
        "@weekly" => "0 0 * * 0",
        "@daily" | "@midnight" => "0 0 * * *",
        "@hourly" => "0 * * * *",
        other if other.starts_with('@') => return Err(format!("unknown macro {other:?}")),
        _ => s,
    })
}

/// The time zone of an IANA name (the tz database is built in, so a container image
/// without `/usr/share/zoneinfo` reads it too).
pub fn time_zone(name: &str) -> Result<jiff::tz::TimeZone, String> {
    jiff::tz::db().get(name).map_err(|_| format!("unknown time zone {name:?}"))
}

impl Schedule {
    /// A schedule read in UTC.
    pub fn parse(s: &str) -> Result<Schedule, CronError> {
        Self::parse_in(s, None)
    }

    /// A schedule read in the IANA time zone `tz` (UTC when `None`).
    pub fn parse_in(s: &str, tz: Option<&str>) -> Result<Schedule, CronError> {
        let err = |reason: String| CronError { schedule: s.to_owned(), reason };
        let tz = match tz {
            Some(name) => time_zone(name).map_err(err)?,
            None => jiff::tz::TimeZone::UTC,
        };
        let fields = expand(s).map_err(err)?;
        let parts: Vec<&str> = fields.split_whitespace().collect();
        let [m, h, dom, mon, dow] = parts.as_slice() else {
            return Err(err("want 5 fields: minute hour day-of-month month day-of-week".into()));
        };
        let (minutes, _) = field(m, 0, 59, "minute", &[]).map_err(err)?;
        let (hours, _) = field(h, 0, 23, "hour", &[]).map_err(err)?;
        let (days, days_restricted) = field(dom, 1, 31, "day-of-month", &[]).map_err(err)?;
        let (months, _) = field(mon, 1, 12, "month", &MONTHS).map_err(err)?;
        let (mut weekdays, weekdays_restricted) = field(dow, 0, 7, "day-of-week", &WEEKDAYS).map_err(err)?;
        if weekdays & (1 << 7) != 0 {
            weekdays |= 1;
        }
        Ok(Schedule { minutes, hours, days, months, weekdays, days_restricted, weekdays_restricted, tz })
    }

    /// Whether the schedule fires at the minute containing `t`, read in its time zone.
    pub fn matches(&self, t: jiff::Timestamp) -> bool {
        let dt = t.to_zoned(self.tz.clone()).datetime();
        let bit = |set: u64, v: i8| set & (1u64 << (v as u32)) != 0;
        let dom = bit(self.days, dt.day());
        let dow = bit(self.weekdays, dt.weekday().to_sunday_zero_offset());
        let day_ok = if self.days_restricted && self.weekdays_restricted { dom || dow } else { dom && dow };
        bit(self.minutes, dt.minute()) && bit(self.hours, dt.hour()) && bit(self.months, dt.month()) && day_ok
    }

    /// Whether a window of `duration` starting at a firing of this schedule covers `now`,
    /// counting the window from `lead` before its start.
    pub fn window_active(
        &self,
        now: jiff::Timestamp,
        duration: jiff::SignedDuration,
        lead: jiff::SignedDuration,
    ) -> bool {
        // A start in (now − duration, now + lead] covers now. Minutes are checked one by one:
        // windows are at most a day long, so this is at most 1,440 + lead steps.
        let Ok(latest) = now.checked_add(lead) else { return false };
        let latest = latest.as_second() - latest.as_second().rem_euclid(60);
        let earliest = now.as_second() - duration.as_secs();
        let mut start = latest;
        while start > earliest {
            if let Ok(t) = jiff::Timestamp::from_second(start)
                && self.matches(t)
            {
                return true;
            }
            start -= 60;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> jiff::Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn schedules_match_their_minutes() {
        let evening = Schedule::parse("0 18 * * 1-5").unwrap();
        assert!(evening.matches(at("2026-11-30T18:00:30Z")), "Monday 18:00");
        assert!(!evening.matches(at("2026-11-29T18:00:00Z")), "Sunday is outside 1-5");
        assert!(!evening.matches(at("2026-11-30T18:01:00Z")));
        let every15 = Schedule::parse("*/15 * * * *").unwrap();
        assert!(every15.matches(at("2026-11-30T03:45:00Z")));
        assert!(!every15.matches(at("2026-11-30T03:46:00Z")));
        let sunday7 = Schedule::parse("0 0 * * 7").unwrap();
        assert!(sunday7.matches(at("2026-11-29T00:00:00Z")));
    }

    #[test]
    fn bad_schedules_say_why() {
        for bad in ["", "* * * *", "60 * * * *", "* 24 * * *", "*/0 * * * *", "a * * * *", "5-1 * * * *"] {
            assert!(Schedule::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_step_beyond_the_range_is_one_value_and_never_overflows() {
        let s = Schedule::parse("1-59/4294967295 * * * *").unwrap();
        assert!(s.matches(at("2026-11-30T03:01:00Z")));
        assert!(!s.matches(at("2026-11-30T03:02:00Z")));
        let s = Schedule::parse("*/4294967295 * * * *").unwrap();
        assert!(s.matches(at("2026-11-30T03:00:00Z")));
        assert!(!s.matches(at("2026-11-30T03:59:00Z")));
    }

    #[test]
    fn a_window_covers_its_duration_and_its_lead_at_the_boundaries() {
        let s = Schedule::parse("0 18 * * *").unwrap();
        let hour = jiff::SignedDuration::from_hours(1);
        let none = jiff::SignedDuration::ZERO;
        assert!(!s.window_active(at("2026-11-30T17:59:59Z"), hour, none), "before the start");
        assert!(s.window_active(at("2026-11-30T18:00:00Z"), hour, none), "at the start");
        assert!(s.window_active(at("2026-11-30T18:59:59Z"), hour, none), "just before the end");
        assert!(!s.window_active(at("2026-11-30T19:00:00Z"), hour, none), "at the end");
        let lead = jiff::SignedDuration::from_mins(5);
        assert!(s.window_active(at("2026-11-30T17:55:00Z"), hour, lead), "lead time counts");
        assert!(!s.window_active(at("2026-11-30T17:54:59Z"), hour, lead));
    }

    #[test]
    fn names_macros_and_question_marks_read_as_cronjob_reads_them() {
        let named = Schedule::parse("30 9 * JAN-mar Mon-FRI").unwrap();
        assert_eq!(named, Schedule::parse("30 9 * 1-3 1-5").unwrap());
        assert_eq!(Schedule::parse("@daily").unwrap(), Schedule::parse("0 0 * * *").unwrap());
        assert_eq!(Schedule::parse("@Midnight").unwrap(), Schedule::parse("0 0 * * *").unwrap());
        assert_eq!(Schedule::parse("@hourly").unwrap(), Schedule::parse("0 * * * *").unwrap());
        assert_eq!(Schedule::parse("@weekly").unwrap(), Schedule::parse("0 0 * * 0").unwrap());
        assert_eq!(Schedule::parse("@monthly").unwrap(), Schedule::parse("0 0 1 * *").unwrap());
        assert_eq!(Schedule::parse("@yearly").unwrap(), Schedule::parse("@annually").unwrap());
        assert_eq!(Schedule::parse("0 0 ? * 1").unwrap(), Schedule::parse("0 0 * * 1").unwrap());
        for bad in ["@reboot", "0 0 * JANUARY *", "0 0 * * funday"] {
            assert!(Schedule::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_day_field_starting_with_a_star_does_not_restrict_so_both_must_match() {
        // 2026-12-01 is a Tuesday (weekday 2), day 1 (odd).
        let tue_1st = at("2026-12-01T00:00:00Z");
        // Both restricted: either matches (the 1st, or any Monday).
        assert!(Schedule::parse("0 0 1 * 1").unwrap().matches(tue_1st));
        // `*/2` in day-of-month (days 1, 3, 5…) is not a restriction: odd days AND Tuesdays.
        let odd_and_tuesday = Schedule::parse("0 0 */2 * 2").unwrap();
        assert!(odd_and_tuesday.matches(tue_1st), "Tuesday the 1st");
        assert!(!odd_and_tuesday.matches(at("2026-12-03T00:00:00Z")), "Thursday the 3rd: not a Tuesday");
        assert!(!odd_and_tuesday.matches(at("2026-12-08T00:00:00Z")), "Tuesday the 8th: an even day");
        // The same days as a range with a step restrict: odd days OR Tuesdays.
        let odd_or_tuesday = Schedule::parse("0 0 1-31/2 * 2").unwrap();
        assert!(odd_or_tuesday.matches(at("2026-12-03T00:00:00Z")), "Thursday the 3rd");
        assert!(odd_or_tuesday.matches(at("2026-12-08T00:00:00Z")), "Tuesday the 8th");
        assert!(!odd_or_tuesday.matches(at("2026-12-10T00:00:00Z")), "Thursday the 10th");
    }

    #[test]
    fn a_schedule_is_read_in_its_time_zone() {
        let paris = Schedule::parse_in("0 18 * * *", Some("Europe/Paris")).unwrap();
        assert!(paris.matches(at("2026-12-01T17:00:00Z")), "18:00 CET is 17:00 UTC in winter");
        assert!(!paris.matches(at("2026-12-01T18:00:00Z")));
        assert!(paris.matches(at("2026-07-01T16:00:00Z")), "18:00 CEST is 16:00 UTC in summer");
        let err = Schedule::parse_in("0 18 * * *", Some("Mars/Olympus")).unwrap_err();
        assert!(err.reason.contains("unknown time zone"), "{err}");
    }

    #[test]
    fn daylight_saving_skips_the_missing_hour_and_repeats_the_doubled_one() {
        // Europe/Paris, 2026: 02:00 → 03:00 on March 29, 03:00 → 02:00 on October 25.
        let at_0230 = Schedule::parse_in("30 2 * * *", Some("Europe/Paris")).unwrap();
        // Firings in [from, to), minute by minute of real time.
        let fires = |from: &str, to: &str| {
            let (from, to) = (at(from).as_second(), at(to).as_second());
            (from..to).step_by(60).filter(|s| at_0230.matches(jiff::Timestamp::from_second(*s).unwrap())).count()
        };
        // Local days in UTC: March 28 (CET, 24 h), March 29 (23 h), October 25 (25 h).
        assert_eq!(fires("2026-03-27T23:00:00Z", "2026-03-28T23:00:00Z"), 1, "an ordinary day: once");
        assert_eq!(fires("2026-03-28T23:00:00Z", "2026-03-29T22:00:00Z"), 0, "02:30 never comes on March 29");
        assert_eq!(fires("2026-10-24T22:00:00Z", "2026-10-25T23:00:00Z"), 2, "02:30 comes twice on October 25");
        // A window follows the same clock: the evening peak stays at 18:00 local time.
        let peak = Schedule::parse_in("0 18 * * *", Some("Europe/Paris")).unwrap();
        let hour = jiff::SignedDuration::from_hours(1);
        assert!(peak.window_active(at("2026-03-28T17:30:00Z"), hour, jiff::SignedDuration::ZERO), "CET");
        assert!(peak.window_active(at("2026-03-30T16:30:00Z"), hour, jiff::SignedDuration::ZERO), "CEST");
        assert!(!peak.window_active(at("2026-03-30T17:30:00Z"), hour, jiff::SignedDuration::ZERO));
    }
}
