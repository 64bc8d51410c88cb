//! Per-operation statistics, which every service (mgmtd, metad, stored, stage agents) keeps of
//! the requests its router serves and answers with `GetStats` (method ids 400–499: served by
//! every kind of service).

use serde::{Deserialize, Serialize};

/// Latency histogram buckets: bucket `i` counts requests that took less than `2^i`
/// microseconds (and at least `2^(i-1)`); the last also holds everything longer.
pub const LATENCY_BUCKETS: usize = 28;

/// Now, in milliseconds since the Unix epoch (0 if the clock is before it).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Whether a request of kind `kind` (an RPC's name, `Lookup`, or a FUSE request's, `lookup`
/// or `lookup (no request)`) answered with `errno` counts under ERRORS. A lookup of a name
/// that does not exist (ENOENT) and an extended attribute that is not there (ENODATA) are
/// answers, asked for all the time (a shell searching its PATH, `ls` probing for ACLs), not
/// errors: counted as such they would hide the real ones.
pub fn counts_as_error(kind: &str, errno: i32) -> bool {
    let first = kind.split(' ').next().unwrap_or(kind);
    let answer = (first.eq_ignore_ascii_case("lookup") && errno == libc::ENOENT)
        || (first.eq_ignore_ascii_case("getxattr") && errno == libc::ENODATA);
    !answer
}

/// When a service (or a mount) started counting: what its snapshots say of it.
#[derive(Debug, Clone, Copy)]
pub struct CountingSince {
    at: std::time::Instant,
    unix_ms: u64,
}

impl Default for CountingSince {
    fn default() -> Self {
        CountingSince { at: std::time::Instant::now(), unix_ms: unix_ms() }
    }
}

impl CountingSince {
    /// A snapshot with its uptime and start time filled in and nothing counted yet.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            uptime_ms: self.at.elapsed().as_millis() as u64,
            started_unix_ms: self.unix_ms,
            ..Default::default()
        }
    }
}

/// What a service has served since it started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetStats {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct StatsSnapshot {
    /// Milliseconds since the service started counting.
    pub uptime_ms: u64,
    /// When it started counting, in milliseconds since the Unix epoch: two snapshots with
    /// different values come from two runs of the service (it restarted in between). 0: unknown.
    #[serde(default)]
    pub started_unix_ms: u64,
    /// One entry per request kind served at least once, by name.
    pub methods: Vec<MethodStats>,
    /// Requests served per client, by client id (the request header's; 0 = a daemon).
    pub clients: Vec<ClientStats>,
    /// Requests served per storage target (stored only).
    pub targets: Vec<TargetStats>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct TargetStats {
    pub target: crate::TargetId,
    pub count: u64,
    pub errors: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ClientStats {
    pub client_id: u64,
    pub count: u64,
    /// Requests by name.
    pub methods: Vec<(String, u64)>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct MethodStats {
    pub name: String,
    pub count: u64,
    /// Requests answered with an error.
    pub errors: u64,
    /// Payload bytes received with the requests (chunk data written).
    pub bytes_in: u64,
    /// Payload bytes sent with the replies (chunk data read).
    pub bytes_out: u64,
    /// Time from a request's arrival to its reply, in power-of-two buckets (see
    /// `LATENCY_BUCKETS`), up to the last one used.
    pub latency_us: Vec<u64>,
}

impl MethodStats {
    /// The latency (upper bound of its bucket, in microseconds) under which a share `q`
    /// (0..=1) of the requests completed; 0 when none was counted.
    pub fn percentile_us(&self, q: f64) -> u64 {
        let total: u64 = self.latency_us.iter().sum();
        if total == 0 {
            return 0;
        }
        let want = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in self.latency_us.iter().enumerate() {
            seen += n;
            if seen >= want {
                return 1u64 << i;
            }
        }
        1u64 << (self.latency_us.len() - 1)
    }
}

/// What every service of a filesystem has served, as `odfs stats` shows it (and the mount's
/// `odfs.stats` attribute holds it, as JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct FsStats {
    pub services: Vec<ServiceStats>,
    /// The clients registered with mgmtd (mounts; one-shot commands do not register), to name
    /// the client ids the services counted.
    pub clients: Vec<crate::mgmt::ServiceInfo>,
    /// When the numbers were gathered, in milliseconds since the Unix epoch (0: unknown, from
    /// an older odfs), so that two snapshots give the time between them.
    #[serde(default)]
    pub taken_unix_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ServiceStats {
    /// "mgmtd", "metad shard 0", "stored node 2", "agent node 1".
    pub name: String,
    /// The service's kind; `None` for mgmtd.
    pub kind: Option<crate::mgmt::ServiceKind>,
    pub node: crate::NodeIndex,
    /// What it has served, or why it could not be asked.
    pub stats: Option<StatsSnapshot>,
    pub error: Option<String>,
}

impl FsStats {
    /// The services that answered, with their numbers.
    pub fn answered(&self) -> impl Iterator<Item = (&ServiceStats, &StatsSnapshot)> {
        self.services.iter().filter_map(|s| Some((s, s.stats.as_ref()?)))
    }

    /// How client id `id` reads: a registered client (a mount) by node, host and pid.
    pub fn client_name(&self, id: u64) -> String {
        match self.clients.iter().find(|c| c.client_id == id) {
            Some(c) => format!("node {} {} pid {}", c.node, c.hostname, c.pid),
            None if id == 0 => "the job's daemons".to_string(),
            None => format!("client {id:016x} (unregistered: a command)"),
        }
    }

    /// The numbers in Prometheus' text exposition format (version 0.0.4): requests, errors,
    /// bytes and latency histograms by service and kind, and requests by client.
    pub fn prometheus(&self) -> String {
        use std::fmt::Write;
        let mut o = String::new();
        let label = |v: &str| v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
        let _ = writeln!(o, "# HELP odfs_service_up Whether the service answered (1) or not (0).");
        let _ = writeln!(o, "# TYPE odfs_service_up gauge");
        for s in &self.services {
            let _ = writeln!(o, "odfs_service_up{{service=\"{}\"}} {}", label(&s.name), u8::from(s.stats.is_some()));
        }
        let families = [
            ("odfs_requests_total", "Requests served, by service and kind.", "counter"),
            ("odfs_request_errors_total", "Requests answered with an error.", "counter"),
            ("odfs_request_bytes_in_total", "Payload bytes received with requests (chunk data written).", "counter"),
            ("odfs_request_bytes_out_total", "Payload bytes sent with replies (chunk data read).", "counter"),
        ];
        for (i, (name, help, kind)) in families.iter().enumerate() {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (s, st) in self.answered() {
                for m in &st.methods {
                    let v = [m.count, m.errors, m.bytes_in, m.bytes_out][i];
                    let _ = writeln!(o, "{name}{{service=\"{}\",request=\"{}\"}} {v}", label(&s.name), label(&m.name));
                }
            }
        }
        let name = "odfs_request_duration_seconds";
        let _ = writeln!(o, "# HELP {name} Time from a request's arrival to its reply.\n# TYPE {name} histogram");
        for (s, st) in self.answered() {
            for m in &st.methods {
                let l = format!("service=\"{}\",request=\"{}\"", label(&s.name), label(&m.name));
                let mut seen = 0;
                for (b, n) in m.latency_us.iter().enumerate() {
                    seen += n;
                    let le = (1u64 << b) as f64 / 1e6;
                    let _ = writeln!(o, "{name}_bucket{{{l},le=\"{le}\"}} {seen}");
                }
                let _ = writeln!(o, "{name}_bucket{{{l},le=\"+Inf\"}} {}", m.count);
                // The sum is estimated from the buckets (each counted at its middle).
                let sum: f64 =
                    m.latency_us.iter().enumerate().map(|(b, n)| *n as f64 * (0.75 * (1u64 << b) as f64)).sum();
                let _ = writeln!(o, "{name}_sum{{{l}}} {}", sum / 1e6);
                let _ = writeln!(o, "{name}_count{{{l}}} {}", m.count);
            }
        }
        for (name, help, pick) in [
            ("odfs_target_requests_total", "Requests served, by storage target.", 0),
            ("odfs_target_bytes_in_total", "Chunk bytes written, by storage target.", 1),
            ("odfs_target_bytes_out_total", "Chunk bytes read, by storage target.", 2),
        ] {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
            for (s, st) in self.answered() {
                for t in &st.targets {
                    let v = [t.count, t.bytes_in, t.bytes_out][pick];
                    let _ = writeln!(o, "{name}{{service=\"{}\",target=\"{}\"}} {v}", label(&s.name), t.target);
                }
            }
        }
        let name = "odfs_client_requests_total";
        let _ = writeln!(o, "# HELP {name} Requests served, by client and service.\n# TYPE {name} counter");
        for (s, st) in self.answered() {
            for c in &st.clients {
                let who = self.client_name(c.client_id);
                let _ = writeln!(o, "{name}{{service=\"{}\",client=\"{}\"}} {}", label(&s.name), label(&who), c.count);
            }
        }
        o
    }
}

/// The histogram bucket of a request that took `us` microseconds.
pub fn latency_bucket(us: u64) -> usize {
    ((u64::BITS - us.leading_zeros()) as usize).min(LATENCY_BUCKETS - 1)
}

crate::rpc! {
    GetStats = 400 => StatsSnapshot,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_name_or_attribute_is_an_answer_not_an_error() {
        for kind in ["Lookup", "lookup", "lookup (no request)"] {
            assert!(!counts_as_error(kind, libc::ENOENT), "{kind}");
            assert!(counts_as_error(kind, libc::EACCES), "{kind}: a refusal is an error");
        }
        for kind in ["GetXattr", "getxattr"] {
            assert!(!counts_as_error(kind, libc::ENODATA), "{kind}");
            assert!(counts_as_error(kind, libc::ENOENT), "{kind}: the file itself missing");
        }
        assert!(counts_as_error("Create", libc::ENOENT) && counts_as_error("rmdir", libc::ENOTEMPTY));
    }

    #[test]
    fn buckets_and_percentiles() {
        assert_eq!(latency_bucket(0), 0);
        assert_eq!(latency_bucket(1), 1);
        assert_eq!(latency_bucket(3), 2);
        assert_eq!(latency_bucket(1000), 10);
        assert_eq!(latency_bucket(u64::MAX), LATENCY_BUCKETS - 1);
        let mut m = MethodStats { latency_us: vec![0; LATENCY_BUCKETS], ..Default::default() };
        assert_eq!(m.percentile_us(0.5), 0);
        m.latency_us[latency_bucket(100)] = 90; // < 128 us
        m.latency_us[latency_bucket(5000)] = 10; // < 8192 us
        assert_eq!(m.percentile_us(0.5), 128);
        assert_eq!(m.percentile_us(0.9), 128);
        assert_eq!(m.percentile_us(0.99), 8192);
    }
}
