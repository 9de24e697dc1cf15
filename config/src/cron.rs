//! Five-field cron schedules (`minute hour day-of-month month day-of-week`, UTC) for
//! capacity reservation windows. Supports `*`, lists, ranges and steps; day-of-week 0 or 7
//! is Sunday. When both day fields are restricted, either may match (classic cron).

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    minutes: u64,
    hours: u64,
    days: u64,
    months: u64,
    weekdays: u64,
    days_restricted: bool,
    weekdays_restricted: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid cron schedule {schedule:?}: {reason}")]
pub struct CronError {
    pub schedule: String,
    pub reason: String,
}

fn field(spec: &str, lo: u32, hi: u32, name: &str) -> Result<(u64, bool), String> {
    let mut bits = 0u64;
    for part in spec.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((r, s)) => (r, s.parse::<u32>().map_err(|_| format!("bad step in {name} field {part:?}"))?),
            None => (part, 1),
        };
        if step == 0 {
            return Err(format!("step 0 in {name} field"));
        }
        let (a, b) = if range == "*" {
            (lo, hi)
        } else if let Some((a, b)) = range.split_once('-') {
            let a = a.parse().map_err(|_| format!("bad {name} {a:?}"))?;
            let b = b.parse().map_err(|_| format!("bad {name} {b:?}"))?;
            (a, b)
        } else {
            let a = range.parse().map_err(|_| format!("bad {name} {range:?}"))?;
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
    Ok((bits, spec != "*"))
}

impl Schedule {
    pub fn parse(s: &str) -> Result<Schedule, CronError> {
        let err = |reason: String| CronError { schedule: s.to_owned(), reason };
        let parts: Vec<&str> = s.split_whitespace().collect();
        let [m, h, dom, mon, dow] = parts.as_slice() else {
            return Err(err("want 5 fields: minute hour day-of-month month day-of-week".into()));
        };
        let (minutes, _) = field(m, 0, 59, "minute").map_err(err)?;
        let (hours, _) = field(h, 0, 23, "hour").map_err(err)?;
        let (days, days_restricted) = field(dom, 1, 31, "day-of-month").map_err(err)?;
        let (months, _) = field(mon, 1, 12, "month").map_err(err)?;
        let (mut weekdays, weekdays_restricted) = field(dow, 0, 7, "day-of-week").map_err(err)?;
        if weekdays & (1 << 7) != 0 {
            weekdays |= 1;
        }
        Ok(Schedule { minutes, hours, days, months, weekdays, days_restricted, weekdays_restricted })
    }

    /// Whether the schedule fires at the minute containing `t`.
    pub fn matches(&self, t: jiff::Timestamp) -> bool {
        let dt = t.to_zoned(jiff::tz::TimeZone::UTC).datetime();
        let bit = |set: u64, v: i8| set & (1u64 << (v as u32)) != 0;
        let dom = bit(self.days, dt.day());
        let dow = bit(self.weekdays, dt.weekday().to_sunday_zero_offset());
        let day_ok = match (self.days_restricted, self.weekdays_restricted) {
            (true, true) => dom || dow,
            (true, false) => dom,
            (false, true) => dow,
            (false, false) => true,
        };
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
}
