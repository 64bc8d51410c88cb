//! What a stage says while it runs: the listing of its source (a count that grows, page by
//! page, marked `412+` until the listing is complete), then its transfer — bytes and items
//! of totals known from the start, a recent rate (over the last [`RATE_WINDOW`], not an
//! average since the start) and the time left at that rate. On a terminal a bar, else a line
//! every `every`; both say the same.

use odfs_proto::stage::StageCounters;
use odfs_proto::units;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The span of the recent rate.
pub(crate) const RATE_WINDOW: Duration = Duration::from_secs(10);

/// Bytes per second over the last `window`, from samples of a growing count.
#[derive(Debug)]
pub(crate) struct RecentRate {
    window: Duration,
    /// (time since the start, bytes then), oldest first; the first is at most `window` old,
    /// or the only one older than that.
    samples: VecDeque<(Duration, u64)>,
}

impl RecentRate {
    pub(crate) fn new(window: Duration) -> RecentRate {
        RecentRate { window, samples: VecDeque::new() }
    }

    /// Notes the count `bytes` at `at` (since the start). A count gone down (a new pass of
    /// work, counted from zero) starts the rate again.
    pub(crate) fn note(&mut self, at: Duration, bytes: u64) {
        if self.samples.back().is_some_and(|&(_, b)| bytes < b) {
            self.samples.clear();
        }
        self.samples.push_back((at, bytes));
        // Keep one sample at or beyond the window's start, so the rate spans the whole window.
        while self.samples.len() > 2 && at.saturating_sub(self.samples[1].0) >= self.window {
            self.samples.pop_front();
        }
    }

    /// Bytes per second between the oldest sample kept and the newest; None before a second
    /// has passed between them.
    pub(crate) fn per_sec(&self) -> Option<f64> {
        let (&(t0, b0), &(t1, b1)) = (self.samples.front()?, self.samples.back()?);
        let secs = t1.saturating_sub(t0).as_secs_f64();
        (secs >= 1.0).then(|| b1.saturating_sub(b0) as f64 / secs)
    }

    /// The seconds the rate spans (at most about the window).
    pub(crate) fn span(&self) -> Duration {
        match (self.samples.front(), self.samples.back()) {
            (Some(a), Some(b)) => b.0.saturating_sub(a.0),
            _ => Duration::ZERO,
        }
    }
}

/// A duration for people: `42 s`, `3 min 05 s`, `2 h 10 min`.
pub(crate) fn duration_text(secs: f64) -> String {
    let s = secs.max(0.0).ceil() as u64;
    match s {
        s if s < 60 => format!("{s} s"),
        s if s < 3600 => format!("{} min {:02} s", s / 60, s % 60),
        s => format!("{} h {:02} min", s / 3600, s / 60 % 60),
    }
}

/// One progress line of a transfer, without the `odfs KIND: ` prefix.
pub(crate) fn transfer_line(
    bytes: u64,
    total: u64,
    done: u64,
    items: u64,
    rate: Option<(f64, Duration)>,
    shares: &str,
) -> String {
    let mut s = format!("{} of {}", units::bytes(bytes), units::bytes(total));
    if total > 0 {
        s += &format!(" ({:.0}%)", 100.0 * bytes.min(total) as f64 / total as f64);
    }
    s += &format!(", {done}/{items} items");
    match rate {
        Some((r, over)) => {
            s += &format!(", {:.0} MiB/s over the last {:.0} s", r / (1u64 << 20) as f64, over.as_secs_f64());
            let left = total.saturating_sub(bytes);
            if left == 0 {
                s += ", ETA 0 s";
            } else if r > 0.0 {
                s += &format!(", ETA {}", duration_text(left as f64 / r));
            } else {
                s += ", ETA unknown (nothing moved lately)";
            }
        }
        None => s += ", rate and ETA after the first second",
    }
    if !shares.is_empty() {
        s += &format!(" ({shares})");
    }
    s
}

/// One progress line of a listing, without the prefix: `412+ files, 1.2 GiB so far` while it
/// pages, the totals once it is complete.
pub(crate) fn listing_line(files: u64, bytes: u64, complete: bool) -> String {
    if complete {
        format!("listing complete: {files} files, {}", units::bytes(bytes))
    } else {
        format!("listing the source: {files}+ files, {}+ so far", units::bytes(bytes))
    }
}

/// A bar on a terminal, else nothing (lines go to the log every `every`).
fn bar(kind: &'static str, len: u64) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new(len);
        b.set_style(
            indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        b.set_prefix(kind);
        b
    })
}

/// The progress of a transfer.
pub(crate) struct Progress {
    bar: Option<indicatif::ProgressBar>,
    kind: &'static str,
    total: u64,
    /// Items of the pass under way (known when it starts: the listing is complete by then).
    items: u64,
    rate: RecentRate,
    last_log: Instant,
    every: Duration,
    start: Instant,
}

impl Progress {
    pub(crate) fn new(kind: &'static str, total: u64, every: Duration) -> Progress {
        Progress {
            bar: bar(kind, total),
            kind,
            total,
            items: 0,
            rate: RecentRate::new(RATE_WINDOW),
            last_log: Instant::now(),
            every,
            start: Instant::now(),
        }
    }

    /// A pass of `n` items begins (the agents learn of their items batch by batch; the line
    /// says the whole pass's from the start).
    pub(crate) fn set_items(&mut self, n: u64) {
        self.items = n;
    }

    pub(crate) fn update(&mut self, per_agent: &[(u32, StageCounters)]) {
        let bytes: u64 = per_agent.iter().map(|(_, c)| c.bytes).sum();
        let done: u64 = per_agent.iter().map(|(_, c)| c.items_done).sum();
        let handed: u64 = per_agent.iter().map(|(_, c)| c.items_total).sum();
        self.rate.note(self.start.elapsed(), bytes);
        let shares: Vec<String> = per_agent
            .iter()
            .map(|(n, c)| format!("n{n}:{:.0}%", if bytes > 0 { 100.0 * c.bytes as f64 / bytes as f64 } else { 0.0 }))
            .collect();
        let rate = self.rate.per_sec().map(|r| (r, self.rate.span()));
        let line = transfer_line(bytes, self.total, done, self.items.max(handed), rate, &shares.join(" "));
        match &self.bar {
            Some(b) => {
                b.set_position(bytes);
                b.set_message(line);
            }
            None if self.last_log.elapsed() >= self.every => {
                self.last_log = Instant::now();
                eprintln!("odfs {}: {line}", self.kind);
            }
            None => {}
        }
    }

    pub(crate) fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// The progress of a listing: files and bytes seen so far, page by page.
pub(crate) struct ListingProgress {
    bar: Option<indicatif::ProgressBar>,
    kind: &'static str,
    files: u64,
    bytes: u64,
    last_log: Instant,
    every: Duration,
}

impl ListingProgress {
    pub(crate) fn new(kind: &'static str, every: Duration) -> ListingProgress {
        let bar = bar(kind, 0);
        if let Some(b) = &bar {
            b.set_style(indicatif::ProgressStyle::with_template("{prefix} {msg}").expect("valid template"));
        }
        ListingProgress { bar, kind, files: 0, bytes: 0, last_log: Instant::now(), every }
    }

    /// A page of `files` files holding `bytes` more.
    pub(crate) fn page(&mut self, files: u64, bytes: u64) {
        self.files += files;
        self.bytes += bytes;
        let line = listing_line(self.files, self.bytes, false);
        match &self.bar {
            Some(b) => b.set_message(line),
            None if self.last_log.elapsed() >= self.every => {
                self.last_log = Instant::now();
                eprintln!("odfs {}: {line}", self.kind);
            }
            None => {}
        }
    }

    /// The listing is complete: says so with its totals (once a listing has taken long
    /// enough to have said anything, or on a terminal).
    pub(crate) fn complete(self, files: u64, bytes: u64) {
        let line = listing_line(files, bytes, true);
        match self.bar {
            Some(b) => {
                b.finish_and_clear();
                eprintln!("odfs {}: {line}", self.kind);
            }
            None => eprintln!("odfs {}: {line}", self.kind),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn s(secs: f64) -> Duration {
        Duration::from_secs_f64(secs)
    }

    #[test]
    fn the_rate_is_over_the_last_ten_seconds_not_since_the_start() {
        let mut r = RecentRate::new(RATE_WINDOW);
        r.note(s(0.0), 0);
        assert_eq!(r.per_sec(), None, "no rate before a second has passed");
        // 100 MiB/s for 20 s, then 10 MiB/s for 15 s.
        for t in 1..=20 {
            r.note(s(t as f64), t * 100 * MIB);
        }
        assert_eq!(r.per_sec(), Some(100.0 * MIB as f64));
        for t in 21..=35 {
            r.note(s(t as f64), 2000 * MIB + (t - 20) * 10 * MIB);
        }
        // The average since the start would be 2150 MiB / 35 s = 61 MiB/s.
        assert_eq!(r.per_sec(), Some(10.0 * MIB as f64));
        assert_eq!(r.span(), s(10.0));
        // A new pass counts from zero: the rate starts again.
        r.note(s(36.0), MIB);
        assert_eq!(r.per_sec(), None);
        r.note(s(38.0), 41 * MIB);
        assert_eq!(r.per_sec(), Some(20.0 * MIB as f64));
    }

    #[test]
    fn a_transfer_line_has_totals_a_recent_rate_and_an_eta() {
        let line =
            transfer_line(1024 * MIB, 4096 * MIB, 120, 5000, Some((100.0 * MIB as f64, s(10.0))), "n0:50% n1:50%");
        assert_eq!(
            line,
            "1.0 GiB of 4.0 GiB (25%), 120/5000 items, 100 MiB/s over the last 10 s, ETA 31 s (n0:50% n1:50%)"
        );
        let line = transfer_line(0, 4096 * MIB, 0, 5000, None, "");
        assert_eq!(line, "0 B of 4.0 GiB (0%), 0/5000 items, rate and ETA after the first second");
        let line = transfer_line(MIB, 4096 * MIB, 1, 5000, Some((0.0, s(10.0))), "");
        assert!(line.ends_with("0 MiB/s over the last 10 s, ETA unknown (nothing moved lately)"), "{line}");
        let line = transfer_line(4096 * MIB, 4096 * MIB, 5000, 5000, Some((1.0, s(10.0))), "");
        assert!(line.contains("(100%)") && line.ends_with("ETA 0 s"), "{line}");
        assert!(transfer_line(10 * MIB, 10_000 * MIB, 1, 9, Some((MIB as f64, s(3.0))), "").ends_with("ETA 2 h 46 min"));
        assert_eq!(duration_text(65.2), "1 min 06 s");
    }

    #[test]
    fn a_listing_is_marked_incomplete_until_it_is_complete() {
        assert_eq!(listing_line(412, 3 * MIB, false), "listing the source: 412+ files, 3.0 MiB+ so far");
        assert_eq!(listing_line(5000, 2048 * MIB, true), "listing complete: 5000 files, 2.0 GiB");
    }
}
