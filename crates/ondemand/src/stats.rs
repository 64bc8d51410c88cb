//! `odfs stats`: what every service of a filesystem has served, by kind of request (count,
//! rate, latency percentiles, errors, bytes) and by client — the view an admin needs when a
//! job "hangs" in a metadata storm. Rendering only; the numbers come from the services'
//! `GetStats` (through the client library, or the mount's `odfs.stats` attribute).

use odfs_proto::stats::{FsStats, MethodStats, ServiceStats, StatsSnapshot, TargetStats};
use std::collections::HashMap;
use std::fmt::Write;

/// One line of the requests table.
struct Row<'a> {
    service: &'a str,
    m: &'a MethodStats,
    rate: f64,
}

/// The two tables: requests by service and kind, then clients. With `before` (an earlier
/// snapshot and the seconds since it) rates are over that interval and rows go by rate, as
/// `odfs stats -w` shows them; without it, rates are averages since each service started.
pub fn render(now: &FsStats, before: Option<(&FsStats, f64)>) -> String {
    let mut out = String::new();
    let mut rows = Vec::new();
    for (s, st) in now.answered() {
        let then = before.map(|(b, secs)| (earlier_snapshot(b, &s.name), service_secs(b, s, st, secs)));
        for m in &st.methods {
            let rate = match then {
                Some((b, secs)) => m.count.saturating_sub(b.map_or(0, |b| count_of(b, &m.name))) as f64 / secs,
                None => m.count as f64 / (st.uptime_ms as f64 / 1000.0).max(1e-3),
            };
            rows.push(Row { service: &s.name, m, rate });
        }
    }
    if before.is_some() {
        rows.sort_by(|a, b| b.rate.total_cmp(&a.rate));
    }
    let _ = writeln!(
        out,
        "{:<16} {:<18} {:>10} {:>9} {:>8} {:>8} {:>7} {:>9} {:>9}",
        "SERVICE", "REQUEST", "COUNT", "RATE/s", "P50", "P99", "ERRORS", "IN", "OUT"
    );
    for r in &rows {
        let _ = writeln!(
            out,
            "{:<16} {:<18} {:>10} {:>9.0} {:>8} {:>8} {:>7} {:>9} {:>9}",
            r.service,
            r.m.name,
            r.m.count,
            r.rate,
            latency(r.m.percentile_us(0.5)),
            latency(r.m.percentile_us(0.99)),
            r.m.errors,
            bytes(r.m.bytes_in),
            bytes(r.m.bytes_out)
        );
    }
    for s in now.services.iter().filter(|s| s.stats.is_none()) {
        let _ = writeln!(out, "{:<16} not asked: {}", s.name, s.error.as_deref().unwrap_or("unknown"));
    }
    out.push('\n');
    render_clients(&mut out, now, before);
    render_targets(&mut out, now, before);
    out
}

/// The first line of an `odfs stats -w` screen: when its numbers were gathered (UTC, to the
/// millisecond, as scripts comparing with their own clocks need) and the interval its rates
/// cover.
pub fn watch_header(now: &FsStats, secs: f64) -> String {
    let ms_of_day = now.taken_unix_ms % 86_400_000;
    let (h, m, s, ms) = (ms_of_day / 3_600_000, ms_of_day / 60_000 % 60, ms_of_day / 1000 % 60, ms_of_day % 1000);
    format!("odfs stats at {h:02}:{m:02}:{s:02}.{ms:03} UTC, rates over the last {secs:.3} s")
}

/// Requests and bytes per storage target (a hot or idle target shows an unbalanced layout).
fn render_targets(out: &mut String, now: &FsStats, before: Option<(&FsStats, f64)>) {
    let targets = |s: &FsStats| -> Vec<(String, TargetStats)> {
        s.answered().flat_map(|(sv, st)| st.targets.iter().map(move |t| (sv.name.clone(), t.clone()))).collect()
    };
    let rows = targets(now);
    if rows.is_empty() {
        return;
    }
    let earlier: HashMap<u32, u64> =
        before.map(|(b, _)| targets(b).into_iter().map(|(_, t)| (t.target, t.count)).collect()).unwrap_or_default();
    let _ = writeln!(
        out,
        "\n{:<8} {:<16} {:>10} {:>9} {:>7} {:>10} {:>10}",
        "TARGET", "SERVICE", "REQUESTS", "RATE/s", "ERRORS", "IN", "OUT"
    );
    for (service, t) in rows {
        let rate = match before {
            Some((_, secs)) => {
                format!("{:.0}", t.count.saturating_sub(*earlier.get(&t.target).unwrap_or(&0)) as f64 / secs.max(1e-3))
            }
            None => "-".into(),
        };
        let _ = writeln!(
            out,
            "{:<8} {:<16} {:>10} {:>9} {:>7} {:>10} {:>10}",
            t.target,
            service,
            t.count,
            rate,
            t.errors,
            bytes(t.bytes_in),
            bytes(t.bytes_out)
        );
    }
}

/// Requests of each client over every service, busiest first, with its three most frequent
/// kinds.
fn render_clients(out: &mut String, now: &FsStats, before: Option<(&FsStats, f64)>) {
    let totals = client_totals(now);
    let earlier = before.map(|(b, secs)| (client_totals(b), secs));
    let mut rows: Vec<(u64, u64, f64, &HashMap<String, u64>)> = totals
        .iter()
        .map(|(id, (n, kinds))| {
            let rate = match &earlier {
                Some((e, secs)) => n.saturating_sub(e.get(id).map_or(0, |x| x.0)) as f64 / secs.max(1e-3),
                None => f64::NAN,
            };
            (*id, *n, rate, kinds)
        })
        .collect();
    rows.sort_by(|a, b| if before.is_some() { b.2.total_cmp(&a.2) } else { b.1.cmp(&a.1) });
    let _ = writeln!(out, "{:<44} {:>10} {:>9}  MOST FREQUENT", "CLIENT", "REQUESTS", "RATE/s");
    for (id, n, rate, kinds) in rows {
        let mut top: Vec<(&String, &u64)> = kinds.iter().collect();
        top.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let top: Vec<String> = top.iter().take(3).map(|(k, v)| format!("{k} {v}")).collect();
        let rate = if rate.is_nan() { "-".to_string() } else { format!("{rate:.0}") };
        let _ = writeln!(out, "{:<44} {:>10} {:>9}  {}", now.client_name(id), n, rate, top.join(", "));
    }
}

/// Each client id's requests over every service: the total and by kind.
fn client_totals(s: &FsStats) -> HashMap<u64, (u64, HashMap<String, u64>)> {
    let mut m: HashMap<u64, (u64, HashMap<String, u64>)> = HashMap::new();
    for c in s.answered().flat_map(|(_, st)| &st.clients) {
        let e = m.entry(c.client_id).or_default();
        e.0 += c.count;
        for (k, n) in &c.methods {
            *e.1.entry(k.clone()).or_default() += n;
        }
    }
    m
}

/// `service`'s numbers in an earlier snapshot, if it answered then.
fn earlier_snapshot<'a>(b: &'a FsStats, service: &str) -> Option<&'a StatsSnapshot> {
    b.answered().find(|(s, _)| s.name == service).map(|(_, st)| st)
}

/// The count of `method` in a service's snapshot (0 if it had none).
fn count_of(st: &StatsSnapshot, method: &str) -> u64 {
    st.methods.iter().find(|m| m.name == method).map_or(0, |m| m.count)
}

/// The seconds between a service's two snapshots by its own clock (its uptime), which is
/// exact whatever the delays in asking it; `secs` (the watcher's) when the service restarted
/// in between or did not answer before.
fn service_secs(b: &FsStats, s: &ServiceStats, now: &StatsSnapshot, secs: f64) -> f64 {
    match earlier_snapshot(b, &s.name) {
        Some(then) if now.uptime_ms > then.uptime_ms => (now.uptime_ms - then.uptime_ms) as f64 / 1000.0,
        _ => secs.max(1e-3),
    }
}

/// A bucket's upper bound for people.
fn latency(us: u64) -> String {
    match us {
        0 => "-".into(),
        u if u < 1000 => format!("<{u}us"),
        u if u < 1_000_000 => format!("<{}ms", u.div_ceil(1000)),
        u => format!("<{}s", u.div_ceil(1_000_000)),
    }
}

fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (mut v, mut i) = (n as f64, 0);
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use odfs_proto::stats::{ClientStats, LATENCY_BUCKETS};

    fn snap(creates: u64, client: u64, uptime_ms: u64) -> FsStats {
        let mut lat = vec![0; LATENCY_BUCKETS];
        lat[7] = creates;
        FsStats {
            services: vec![ServiceStats {
                name: "metad shard 0".into(),
                kind: Some(odfs_proto::mgmt::ServiceKind::Meta),
                node: 0,
                stats: Some(StatsSnapshot {
                    uptime_ms,
                    methods: vec![MethodStats {
                        name: "Create".into(),
                        count: creates,
                        latency_us: lat,
                        ..Default::default()
                    }],
                    clients: vec![ClientStats {
                        client_id: client,
                        count: creates,
                        methods: vec![("Create".into(), creates)],
                    }],
                    targets: vec![],
                }),
                error: None,
            }],
            clients: vec![],
            taken_unix_ms: 0,
        }
    }

    #[test]
    fn the_watch_header_names_the_time_of_day_in_utc() {
        let mut s = snap(0, 7, 1);
        s.taken_unix_ms = 1_795_748_462_345; // 2026-11-27 03:01:02.345 UTC
        assert_eq!(watch_header(&s, 4.25), "odfs stats at 03:01:02.345 UTC, rates over the last 4.250 s");
    }

    #[test]
    fn rates_are_over_the_interval_when_watching() {
        let create_rate = |text: &str| -> String {
            let line = text.lines().find(|l| l.contains("Create")).unwrap();
            let f: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(f[4], "3000", "{line}");
            assert_eq!(f[6], "<128us", "{line}");
            f[5].to_string()
        };
        // The service's own clock gives the interval: 2000 creates in 2.5 s, whatever the
        // watcher measured between its requests.
        let (a, b) = (snap(1000, 7, 10_000), snap(3000, 7, 12_500));
        let text = render(&b, Some((&a, 2.0)));
        assert_eq!(create_rate(&text), "800", "{text}");
        assert!(text.contains("client 0000000000000007 (unregistered: a command)"), "{text}");
        // A service that restarted in between: the watcher's interval.
        let text = render(&snap(3000, 7, 500), Some((&a, 2.0)));
        assert_eq!(create_rate(&text), "1000", "{text}");
        // Since start: 3000 over 12.5 s.
        assert_eq!(create_rate(&render(&b, None)), "240");
    }
}
