//! `odfs status`: the filesystem state and every node, service and target.

use anyhow::Result;
use odfs_proto::mgmt::{ClusterView, ServiceKind};
use odfs_proto::units::bytes as human_bytes;
use std::fmt::Write;

pub fn render(v: &ClusterView) -> Result<String> {
    let mut s = String::new();
    // What serves: a registered service that stopped answering (OFFLINE) does not count.
    let serving = |kind: ServiceKind| v.services.iter().filter(|x| x.kind == kind && x.online).count();
    writeln!(
        s,
        "job {}  state {:?}  storage services {}/{}  meta {}/{}",
        v.job_id,
        v.state,
        serving(ServiceKind::Storage),
        v.expected_storage_nodes,
        serving(ServiceKind::Meta),
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

#[cfg(test)]
mod tests {
    use super::*;
    use odfs_proto::mgmt::{FsState, ServiceInfo};

    fn service(id: u64, kind: ServiceKind, node: u32, online: bool) -> ServiceInfo {
        ServiceInfo {
            id,
            kind,
            node,
            hostname: "localhost".into(),
            addr: None,
            bulk_addr: None,
            shard: None,
            online,
            last_seen_ms: 0,
            pid: 1,
            client_id: 0,
        }
    }

    #[test]
    fn only_serving_services_are_counted() {
        let mut v = ClusterView {
            job_id: "7".into(),
            state: FsState::Ready,
            created: Default::default(),
            expected_storage_nodes: 4,
            expected_meta: 1,
            services: (0..4).map(|n| service(u64::from(n) + 1, ServiceKind::Storage, n, n != 2)).collect(),
            targets: vec![],
            default_layout: Default::default(),
            version: 1,
            pools: vec![],
        };
        v.services.push(service(9, ServiceKind::Meta, 0, true));
        let text = render(&v).unwrap();
        assert!(text.starts_with("job 7  state Ready  storage services 3/4  meta 1/1\n"), "{text}");
        assert_eq!(text.matches("OFFLINE").count(), 1, "{text}");
        v.services[4].online = false;
        assert!(render(&v).unwrap().contains("meta 0/1"));
    }
}
