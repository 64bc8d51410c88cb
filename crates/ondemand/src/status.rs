//! `odfs status`: the filesystem state and every node, service and target.

use anyhow::Result;
use odfs_proto::mgmt::{ClusterView, ServiceKind};
use odfs_proto::units::bytes as human_bytes;
use std::fmt::Write;

pub fn render(v: &ClusterView) -> Result<String> {
    let mut s = String::new();
    let storage = v.services.iter().filter(|x| x.kind == ServiceKind::Storage).count();
    writeln!(
        s,
        "job {}  state {:?}  storage services {}/{}  meta {}/{}",
        v.job_id,
        v.state,
        storage,
        v.expected_storage_nodes,
        v.services.iter().filter(|x| x.kind == ServiceKind::Meta).count(),
        v.expected_meta
    )?;
    writeln!(s, "\nSERVICE  ID  NODE  HOST        ADDRESS                 STATE    LAST SEEN")?;
    for x in &v.services {
        let kind = x.kind.name();
        let addr = x.addr.map(|a| a.to_string()).unwrap_or_else(|| "-".into());
        writeln!(
            s,
            "{kind:<8} {:>3} {:>5}  {:<11} {:<23} {:<8} {} ms",
            x.id,
            x.node,
            x.hostname,
            addr,
            if x.online { "online" } else { "OFFLINE" },
            x.last_seen_ms
        )?;
    }
    writeln!(s, "\nTARGET  NODE  POOL        SIZE        FREE        STATE")?;
    for t in &v.targets {
        writeln!(
            s,
            "{:>6} {:>5}  {:<11} {:<11} {:<11} {}",
            t.id,
            t.node,
            t.pool,
            human_bytes(t.space.capacity),
            human_bytes(t.space.free),
            if t.online { "online" } else { "OFFLINE" }
        )?;
    }
    Ok(s)
}
