//! The statistics of one server: every request its router serves, counted by method (count,
//! errors, payload bytes, a latency histogram) and by client. One lock per request, held for
//! a few additions; `GetStats` copies it out. Also here: gathering every service's numbers
//! into one `FsStats` (for `odfs stats` and mgmtd's Prometheus endpoint).

use crate::{Pool, Transport};
use odfs_proto::mgmt::{ServiceInfo, ServiceKind};
use odfs_proto::stats::{
    latency_bucket, ClientStats, CountingSince, FsStats, GetStats, MethodStats, ServiceStats, StatsSnapshot,
    TargetStats, LATENCY_BUCKETS,
};
use odfs_proto::RequestHeader;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

/// One served request, as counted.
pub(crate) struct Served {
    pub method: u16,
    pub name: &'static str,
    pub client: u64,
    /// The storage target the request was for, if any.
    pub target: Option<odfs_proto::TargetId>,
    pub took: Duration,
    pub error: bool,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

struct Method {
    name: &'static str,
    count: u64,
    errors: u64,
    bytes_in: u64,
    bytes_out: u64,
    latency: [u64; LATENCY_BUCKETS],
}

#[derive(Default)]
struct Counts {
    methods: HashMap<u16, Method>,
    /// Requests by client id and method id.
    clients: HashMap<(u64, u16), u64>,
    targets: HashMap<odfs_proto::TargetId, TargetStats>,
}

/// A router's counters.
pub struct Stats {
    since: CountingSince,
    counts: Mutex<Counts>,
}

impl Default for Stats {
    fn default() -> Self {
        Stats { since: CountingSince::default(), counts: Mutex::new(Counts::default()) }
    }
}

impl Stats {
    /// Counts one operation carried inside another request (an entry of metad's `CreateBatch`)
    /// as a request of its own kind `R` from `client`, so that the counts by kind stay the
    /// operations done, however they arrived.
    pub fn record_carried<R: odfs_proto::Rpc>(&self, client: u64, took: Duration, error: bool) {
        self.record(Served {
            method: R::METHOD,
            name: R::NAME,
            client,
            target: None,
            took,
            error,
            bytes_in: 0,
            bytes_out: 0,
        });
    }

    pub(crate) fn record(&self, s: Served) {
        let bucket = latency_bucket(s.took.as_micros() as u64);
        let mut c = self.counts.lock().expect("stats lock");
        let m = c.methods.entry(s.method).or_insert_with(|| Method {
            name: s.name,
            count: 0,
            errors: 0,
            bytes_in: 0,
            bytes_out: 0,
            latency: [0; LATENCY_BUCKETS],
        });
        m.count += 1;
        m.errors += u64::from(s.error);
        m.bytes_in += s.bytes_in;
        m.bytes_out += s.bytes_out;
        m.latency[bucket] += 1;
        *c.clients.entry((s.client, s.method)).or_default() += 1;
        if let Some(t) = s.target {
            let e = c.targets.entry(t).or_insert_with(|| TargetStats { target: t, ..Default::default() });
            e.count += 1;
            e.errors += u64::from(s.error);
            e.bytes_in += s.bytes_in;
            e.bytes_out += s.bytes_out;
        }
    }

    /// Everything counted so far, methods by name.
    pub fn snapshot(&self) -> StatsSnapshot {
        let c = self.counts.lock().expect("stats lock");
        let mut methods: Vec<MethodStats> = c
            .methods
            .values()
            .map(|m| MethodStats {
                name: m.name.to_string(),
                count: m.count,
                errors: m.errors,
                bytes_in: m.bytes_in,
                bytes_out: m.bytes_out,
                // Up to the last bucket used: most requests take microseconds, not minutes.
                latency_us: m.latency[..m.latency.iter().rposition(|n| *n > 0).map_or(0, |i| i + 1)].to_vec(),
            })
            .collect();
        methods.sort_by(|a, b| a.name.cmp(&b.name));
        let mut by_client: HashMap<u64, ClientStats> = HashMap::new();
        for ((client, method), n) in &c.clients {
            let e =
                by_client.entry(*client).or_insert_with(|| ClientStats { client_id: *client, ..Default::default() });
            e.count += n;
            let name = c.methods.get(method).map_or("?", |m| m.name);
            e.methods.push((name.to_string(), *n));
        }
        let mut clients: Vec<ClientStats> = by_client.into_values().collect();
        for cl in &mut clients {
            cl.methods.sort();
        }
        clients.sort_by_key(|cl| cl.client_id);
        let mut targets: Vec<TargetStats> = c.targets.values().cloned().collect();
        targets.sort_by_key(|t| t.target);
        StatsSnapshot { methods, clients, targets, ..self.since.snapshot() }
    }
}

/// Every service's numbers: mgmtd's (`mgmtd`: its snapshot, or why it has none), then those of
/// each service in `services` that `route` can reach, asked one after another; a service that
/// is offline or does not answer is listed with the reason. Clients are listed to name the
/// client ids counted.
pub async fn gather(
    pool: &Pool,
    header: &RequestHeader,
    mgmtd: Result<StatsSnapshot, String>,
    services: &[ServiceInfo],
    route: impl Fn(&ServiceInfo) -> Option<(SocketAddr, Transport)>,
) -> FsStats {
    let (stats, error) = split(mgmtd);
    let mut out = FsStats {
        services: vec![ServiceStats { name: "mgmtd".into(), kind: None, node: 0, stats, error }],
        clients: Vec::new(),
        taken_unix_ms: 0,
    };
    for s in services {
        let name = match s.kind {
            ServiceKind::Client => {
                out.clients.push(s.clone());
                continue;
            }
            ServiceKind::Meta => format!("metad shard {}", s.shard.unwrap_or(0)),
            ServiceKind::Storage => format!("stored node {}", s.node),
            ServiceKind::Agent => format!("agent node {}", s.node),
        };
        let (stats, error) = match route(s) {
            _ if !s.online => (None, Some("offline".to_string())),
            Some((addr, t)) => split(pool.call(addr, t, header, &GetStats {}).await.map_err(|e| e.to_string())),
            None => (None, Some("no address".to_string())),
        };
        out.services.push(ServiceStats { name, kind: Some(s.kind), node: s.node, stats, error });
    }
    out.taken_unix_ms = odfs_proto::stats::unix_ms();
    out
}

fn split(r: Result<StatsSnapshot, String>) -> (Option<StatsSnapshot>, Option<String>) {
    match r {
        Ok(s) => (Some(s), None),
        Err(e) => (None, Some(e)),
    }
}
