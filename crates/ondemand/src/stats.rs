//! `odfs stats`: what every service of a filesystem has served, by kind of request (count,
//! rate, latency percentiles, errors, bytes) and by client — the view an admin needs when a
//! job "hangs" in a metadata storm. Rendering only; the numbers come from the services'
//! `GetStats` (through the client library, or the mount's `odfs.stats` attribute).

use odfs_proto::stats::{FsStats, MethodStats, StatsSnapshot};
use std::collections::HashMap;
use std::fmt::Write;

/// One line of the requests table.
struct Row<'a> {
    service: &'a str,
    m: &'a MethodStats,
    rate: f64,
}

/// The tables: requests by service and kind, by client, by target. With `before` (an earlier
/// snapshot and the seconds since it) rates are over that interval and rows go by rate, as
/// `odfs stats -w` shows them; without it, rates are averages since each service started.
pub fn render(now: &FsStats, before: Option<(&FsStats, f64)>) -> String {
    let mut out = String::new();
    let mut rows = Vec::new();
    for (s, st) in now.answered() {
        let span = Span::of(before.map(|(b, _)| b), &s.name, st);
        for m in &st.methods {
            rows.push(Row { service: &s.name, m, rate: span.rate(m.count, |then| count_of(then, &m.name)) });
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
    if now.taken_unix_ms == 0 {
        return format!("odfs stats at an unknown time (an older odfs), rates over the last {secs:.3} s");
    }
    let at = odfs_proto::time::utc_clock_ms(now.taken_unix_ms);
    format!("odfs stats at {at}, rates over the last {secs:.3} s")
}

/// Requests and bytes per storage target (a hot or idle target shows an unbalanced layout);
/// rates only when watching.
fn render_targets(out: &mut String, now: &FsStats, before: Option<(&FsStats, f64)>) {
    if now.answered().all(|(_, st)| st.targets.is_empty()) {
        return;
    }
    let _ = writeln!(
        out,
        "\n{:<8} {:<16} {:>10} {:>9} {:>7} {:>10} {:>10}",
        "TARGET", "SERVICE", "REQUESTS", "RATE/s", "ERRORS", "IN", "OUT"
    );
    for (s, st) in now.answered() {
        let span = before.map(|(b, _)| Span::of(Some(b), &s.name, st));
        for t in &st.targets {
            let rate = match &span {
                Some(span) => format!("{:.0}", span.rate(t.count, |then| target_count(then, t.target))),
                None => "-".into(),
            };
            let _ = writeln!(
                out,
                "{:<8} {:<16} {:>10} {:>9} {:>7} {:>10} {:>10}",
                t.target,
                s.name,
                t.count,
                rate,
                t.errors,
                bytes(t.bytes_in),
                bytes(t.bytes_out)
            );
        }
    }
}

/// Requests of each client over every service, busiest first, with its three most frequent
/// kinds. Commands (`odfs cp`, `odfs stats`, stage coordinators: clients that never register)
/// are one row: each is a new client id, and a job's scripts run hundreds.
fn render_clients(out: &mut String, now: &FsStats, before: Option<(&FsStats, f64)>) {
    let totals = client_totals(now);
    let earlier = before.map(|(b, secs)| (client_totals(b), secs));
    let mut rows: Vec<(&Who, &ClientTotal, f64)> = totals
        .iter()
        .map(|(who, t)| {
            let rate = match &earlier {
                Some((e, secs)) => t.count.saturating_sub(e.get(who).map_or(0, |x| x.count)) as f64 / secs.max(1e-3),
                None => f64::NAN,
            };
            (who, t, rate)
        })
        .collect();
    rows.sort_by(|a, b| if before.is_some() { b.2.total_cmp(&a.2) } else { b.1.count.cmp(&a.1.count) });
    let _ = writeln!(out, "{:<44} {:>10} {:>9}  MOST FREQUENT", "CLIENT", "REQUESTS", "RATE/s");
    for (who, t, rate) in rows {
        let mut top: Vec<(&String, &u64)> = t.kinds.iter().collect();
        top.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let top: Vec<String> = top.iter().take(3).map(|(k, v)| format!("{k} {v}")).collect();
        let rate = if rate.is_nan() { "-".to_string() } else { format!("{rate:.0}") };
        let name = match who {
            Who::Client(id) => now.client_name(*id),
            Who::Commands => match t.ids {
                1 => "odfs commands (1 unregistered client)".to_string(),
                n => format!("odfs commands ({n} unregistered clients)"),
            },
        };
        let _ = writeln!(out, "{name:<44} {:>10} {:>9}  {}", t.count, rate, top.join(", "));
    }
}

/// A row of the clients table: a registered client (a mount, a daemon) or every command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Who {
    Client(u64),
    Commands,
}

/// A row's requests over every service: the total, by kind, and the client ids it covers.
#[derive(Default)]
struct ClientTotal {
    count: u64,
    kinds: HashMap<String, u64>,
    ids: usize,
}

/// Each row's requests over every service.
fn client_totals(s: &FsStats) -> HashMap<Who, ClientTotal> {
    let registered = |id: u64| id == 0 || s.clients.iter().any(|c| c.client_id == id);
    let mut m: HashMap<Who, ClientTotal> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for c in s.answered().flat_map(|(_, st)| &st.clients) {
        let who = if registered(c.client_id) { Who::Client(c.client_id) } else { Who::Commands };
        let e = m.entry(who).or_default();
        e.count += c.count;
        e.ids += usize::from(seen.insert(c.client_id));
        for (k, n) in &c.methods {
            *e.kinds.entry(k.clone()).or_default() += n;
        }
    }
    m
}

/// What a service's rates are over: its earlier snapshot of the same run and the seconds since
/// it by the service's own clock (exact whatever the delays in asking it); without one (not
/// watching, restarted, or no answer before), its counts over its uptime.
struct Span<'a> {
    then: Option<&'a StatsSnapshot>,
    secs: f64,
}

impl<'a> Span<'a> {
    fn of(before: Option<&'a FsStats>, service: &str, now: &StatsSnapshot) -> Span<'a> {
        let then = before.and_then(|b| same_run(b, service, now));
        let ms = now.uptime_ms.saturating_sub(then.map_or(0, |t| t.uptime_ms));
        Span { then, secs: (ms as f64 / 1000.0).max(1e-3) }
    }

    /// Per second: a count now less the same count in the earlier snapshot.
    fn rate(&self, count: u64, earlier: impl Fn(&StatsSnapshot) -> u64) -> f64 {
        count.saturating_sub(self.then.map_or(0, earlier)) as f64 / self.secs
    }
}

/// `service`'s numbers in an earlier snapshot, if it answered then and has run since: not
/// restarted (another start time, a shorter uptime, or a count gone down).
fn same_run<'a>(b: &'a FsStats, service: &str, now: &StatsSnapshot) -> Option<&'a StatsSnapshot> {
    let then = b.answered().find(|(s, _)| s.name == service).map(|(_, st)| st)?;
    let restarted =
        (then.started_unix_ms != 0 && now.started_unix_ms != 0 && then.started_unix_ms != now.started_unix_ms)
            || now.uptime_ms <= then.uptime_ms
            || then.methods.iter().any(|m| count_of(now, &m.name) < m.count);
    (!restarted).then_some(then)
}

/// The count of `method` in a service's snapshot (0 if it had none).
fn count_of(st: &StatsSnapshot, method: &str) -> u64 {
    st.methods.iter().find(|m| m.name == method).map_or(0, |m| m.count)
}

/// The count of requests to `target` in a service's snapshot (0 if it had none).
fn target_count(st: &StatsSnapshot, target: u32) -> u64 {
    st.targets.iter().find(|t| t.target == target).map_or(0, |t| t.count)
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
    use odfs_proto::stats::{ClientStats, ServiceStats, LATENCY_BUCKETS};

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
                    started_unix_ms: 1,
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
    fn commands_are_one_row_and_registered_clients_one_each() {
        // A mount (registered) and 30 commands, each its own unregistered client id.
        let mut st = snap(0, 0, 1000);
        let clients = &mut st.services[0].stats.as_mut().unwrap().clients;
        clients.clear();
        clients.push(ClientStats { client_id: 42, count: 500, methods: vec![("Create".into(), 500)] });
        for id in 100..130 {
            clients.push(ClientStats { client_id: id, count: 3, methods: vec![("Lookup".into(), 3)] });
        }
        st.clients.push(odfs_proto::mgmt::ServiceInfo {
            id: 5,
            kind: odfs_proto::mgmt::ServiceKind::Client,
            node: 1,
            hostname: "n1".into(),
            addr: None,
            bulk_addr: None,
            shard: None,
            online: true,
            last_seen_ms: 0,
            pid: 777,
            client_id: 42,
        });
        let text = render(&st, None);
        let table: Vec<&str> =
            text.split("CLIENT").nth(1).unwrap().lines().skip(1).take_while(|l| !l.is_empty()).collect();
        assert_eq!(table.len(), 2, "{text}");
        assert!(table[0].starts_with("node 1 n1 pid 777") && table[0].contains(" 500 "), "{text}");
        assert!(table[1].starts_with("odfs commands (30 unregistered clients)"), "{text}");
        assert!(table[1].contains(" 90 ") && table[1].ends_with("Lookup 90"), "{text}");
        assert!(!text.contains("unregistered: a command"), "{text}");
    }

    #[test]
    fn the_watch_header_names_the_time_of_day_in_utc() {
        let mut s = snap(0, 7, 1);
        s.taken_unix_ms = 1_795_748_462_345; // 2026-11-27 03:01:02.345 UTC
        assert_eq!(watch_header(&s, 4.25), "odfs stats at 03:01:02.345 UTC, rates over the last 4.250 s");
        s.taken_unix_ms = 0;
        assert!(watch_header(&s, 4.25).starts_with("odfs stats at an unknown time"));
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
        assert!(text.contains("odfs commands (1 unregistered client)"), "{text}");
        // A service that restarted in between: its counts over its uptime (3000 in 1.5 s),
        // whether its start time, its uptime or its counts show the restart.
        let mut restarted = snap(3000, 7, 12_500);
        restarted.services[0].stats.as_mut().unwrap().started_unix_ms = 99;
        for (later, why) in [(snap(3000, 7, 1500), "uptime"), (restarted, "start time")] {
            let mut later = later.clone();
            later.services[0].stats.as_mut().unwrap().uptime_ms = 1500;
            let text = render(&later, Some((&a, 2.0)));
            assert_eq!(create_rate(&text), "2000", "{why}: {text}");
        }
        let text = render(&snap(500, 7, 12_500), Some((&a, 2.0)));
        let line = text.lines().find(|l| l.contains("Create")).unwrap();
        assert_eq!(line.split_whitespace().nth(5), Some("40"), "a count gone down: 500 over 12.5 s: {text}");
        // Since start: 3000 over 12.5 s.
        assert_eq!(create_rate(&render(&b, None)), "240");
    }
}
