//! Placement: which storage targets a new file's chunks go to.
//!
//! Owns metad's view of the targets (from mgmtd's cluster view: pool, free space, node, online)
//! and the choice: round-robin over a pool's online targets from a rotating start, targets with
//! free space first, the creating node's own target first under local placement; and the
//! refusal, with the reason, of a layout that could not be honoured.

use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::{DirLayout, Layout, NodeIndex, TargetId};
use std::collections::HashMap;

/// How a create's refusal for a pool with no online target ends (`service::mutate_fresh`
/// waits, bounded, for targets to register again after mgmtd's restart).
pub const NO_ONLINE_TARGETS: &str = "has no online targets";

/// A storage target as the store sees it when placing new files (from mgmtd's cluster view).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetChoice {
    pub id: TargetId,
    /// Storage pool the target belongs to; layouts name a pool.
    pub pool: String,
    /// Free bytes; targets with none are used only to make up a stripe count.
    pub free: u64,
    /// Total bytes, for statfs.
    pub capacity: u64,
    /// Offline targets get no new files and do not count in statfs.
    pub online: bool,
    /// The node whose stored serves it (local placement).
    pub node: NodeIndex,
    /// Its filesystem: targets on one device count once in statfs (`TargetSpace::device`).
    pub device: u64,
}

/// Chooses the targets of new files: round-robin over a pool's online targets from a rotating
/// start, preferring targets with free space.
pub(crate) struct Placement {
    targets: Vec<TargetChoice>,
    /// Online targets of each pool in id order, with whether they have free space and their
    /// node.
    pools: HashMap<String, Vec<(TargetId, bool, NodeIndex)>>,
    /// Rotating start; seeded randomly so restarts do not all begin at the first target.
    next: u64,
}

impl Placement {
    pub(crate) fn new() -> Placement {
        Placement { targets: Vec::new(), pools: HashMap::new(), next: rand::random::<u32>() as u64 }
    }

    pub(crate) fn set(&mut self, mut targets: Vec<TargetChoice>) {
        targets.sort_by_key(|t| t.id);
        self.pools.clear();
        for t in targets.iter().filter(|t| t.online) {
            self.pools.entry(t.pool.clone()).or_default().push((t.id, t.free > 0, t.node));
        }
        self.targets = targets;
    }

    /// Capacity and free bytes of the online targets, each device counted once (statfs).
    pub(crate) fn space(&self) -> (u64, u64) {
        let mut seen = std::collections::BTreeSet::new();
        self.targets
            .iter()
            .filter(|t| t.online && odfs_proto::mgmt::first_on_device(&mut seen, t.device))
            .fold((0u64, 0u64), |(c, f), t| (c.saturating_add(t.capacity), f.saturating_add(t.free)))
    }

    /// Refuses a layout that could not be honoured, naming why: an unknown or empty pool, more
    /// stripes than the pool has targets, a start target outside the pool. (Placement itself
    /// uses what is online; this judges against every known target of the pool.)
    pub(crate) fn check(&self, dl: &DirLayout) -> RpcResult<()> {
        let invalid = |m: String| RemoteError::new(ErrorCode::Invalid, m);
        dl.validate().map_err(invalid)?;
        let members: Vec<TargetId> = self.targets.iter().filter(|t| t.pool == dl.pool).map(|t| t.id).collect();
        if members.is_empty() {
            let mut known: Vec<&str> = self.targets.iter().map(|t| t.pool.as_str()).collect();
            known.sort();
            known.dedup();
            return Err(invalid(format!(
                "pool \"{}\" does not exist or has no targets (pools with targets: {})",
                dl.pool,
                known.join(", ")
            )));
        }
        if dl.stripe_count > members.len() as i32 {
            return Err(invalid(format!(
                "stripe count {} is more than the {} targets of pool \"{}\"",
                dl.stripe_count,
                members.len(),
                dl.pool
            )));
        }
        if let Some(t) = dl.start_target {
            if !members.contains(&t) {
                return Err(invalid(format!("start target {t} is not in pool \"{}\" (targets {members:?})", dl.pool)));
            }
        }
        Ok(())
    }

    /// The targets of a new file with layout `dl`, created by a client on `node`; a pool with
    /// none online is refused ending in [`NO_ONLINE_TARGETS`].
    pub(crate) fn choose(&mut self, dl: &DirLayout, node: Option<NodeIndex>) -> RpcResult<Layout> {
        let invalid = |m: String| RemoteError::new(ErrorCode::Invalid, m);
        dl.validate().map_err(invalid)?;
        let cands = match self.pools.get(&dl.pool) {
            Some(c) if !c.is_empty() => c,
            _ => return Err(invalid(format!("pool \"{}\" {NO_ONLINE_TARGETS}", dl.pool))),
        };
        let n = cands.len();
        let want = if dl.stripe_count < 0 { n } else { dl.stripe_count as usize };
        // As Lustre: a file gets at most as many stripes as its pool has targets online. An
        // explicit layout asking for more is refused where it is set (setstripe), not here.
        let want = want.min(n);
        if !cands.iter().any(|&(_, free, _)| free) {
            return Err(RemoteError::new(ErrorCode::NoSpace, format!("every target of pool \"{}\" is full", dl.pool)));
        }
        let start = match dl.start_target {
            Some(t) if !dl.local => cands.iter().position(|&(id, _, _)| id >= t).unwrap_or(0),
            _ => {
                self.next = self.next.wrapping_add(1);
                (self.next % n as u64) as usize
            }
        };
        let mut targets = Vec::with_capacity(want);
        // Local placement: the first stripe on one of the creating node's online targets with
        // free space (rotating among them); without one, the usual rotation.
        if let (true, Some(node)) = (dl.local, node) {
            let own = (0..n).map(|i| cands[(start + i) % n]).find(|&(_, free, at)| free && at == node);
            if let Some((id, _, _)) = own {
                targets.push(id);
            }
        }
        // Rotated order, targets with free space first, full ones only to make up the count.
        for pass in [true, false] {
            for i in 0..n {
                let (id, free, _) = cands[(start + i) % n];
                if free == pass && targets.len() < want && !targets.contains(&id) {
                    targets.push(id);
                }
            }
        }
        Ok(Layout { chunk_size: dl.chunk_size, pool: dl.pool.clone(), targets })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(id: TargetId, pool: &str, free: u64, online: bool) -> TargetChoice {
        TargetChoice { id, pool: pool.into(), free, capacity: 100, online, node: id / 10, device: 0 }
    }

    fn dl(stripes: i32, pool: &str) -> DirLayout {
        DirLayout { stripe_count: stripes, pool: pool.into(), ..DirLayout::default() }
    }

    impl Placement {
        fn choose_for(&mut self, dl: &DirLayout) -> RpcResult<Layout> {
            self.choose(dl, Some(0))
        }
    }

    #[test]
    fn local_placement_puts_the_first_stripe_on_the_creating_node() {
        let mut p = Placement::new();
        // Targets 10, 11 on node 1 (11 full), 20, 21 on node 2, 30 on node 3 (offline), 40 on
        // node 4 in another pool.
        p.set(vec![
            target(10, "a", 10, true),
            target(11, "a", 0, true),
            target(20, "a", 10, true),
            target(21, "a", 10, true),
            target(30, "a", 10, false),
            target(40, "b", 10, true),
        ]);
        let local = |stripes| DirLayout { local: true, ..dl(stripes, "a") };
        for _ in 0..8 {
            assert_eq!(p.choose(&local(1), Some(1)).unwrap().targets, vec![10], "node 1's target with space");
        }
        let mut node2 = std::collections::HashSet::new();
        for _ in 0..8 {
            let l = p.choose(&local(3), Some(2)).unwrap();
            assert_eq!(l.targets.len(), 3);
            assert!([20, 21].contains(&l.targets[0]), "{l:?}");
            let mut uniq = l.targets.clone();
            uniq.sort();
            uniq.dedup();
            assert_eq!(uniq.len(), 3, "a target used twice: {l:?}");
            node2.insert(l.targets[0]);
        }
        assert_eq!(node2.len(), 2, "the node's own targets do not rotate");
        // No usable target on the node (offline, other pool, unknown node, no node given):
        // the usual rotation, never an error.
        for node in [Some(3), Some(4), Some(9), None] {
            let l = p.choose(&local(1), node).unwrap();
            assert!([10, 20, 21].contains(&l.targets[0]), "{node:?}: {l:?}");
        }
        // Without `local` the node does not matter; a start target is ignored with it.
        let firsts: std::collections::HashSet<_> =
            (0..12).map(|_| p.choose(&dl(1, "a"), Some(1)).unwrap().targets[0]).collect();
        assert!(firsts.len() > 1, "rotation stuck: {firsts:?}");
        let pinned = DirLayout { start_target: Some(20), ..local(1) };
        assert_eq!(p.choose(&pinned, Some(1)).unwrap().targets, vec![10]);
    }

    #[test]
    fn placement_rotates_prefers_free_and_checks_the_pool() {
        let mut p = Placement::new();
        p.set(vec![
            target(4, "a", 10, true),
            target(1, "a", 10, true),
            target(2, "a", 0, true),
            target(3, "a", 10, false),
            target(9, "b", 0, true),
        ]);
        // Online targets of "a": 1, 2 (full), 4.
        let mut firsts = std::collections::HashSet::new();
        for _ in 0..6 {
            let l = p.choose_for(&dl(2, "a")).unwrap();
            assert_eq!(l.targets.len(), 2);
            assert!(!l.targets.contains(&2), "a full target was used: {l:?}");
            firsts.insert(l.targets[0]);
        }
        assert_eq!(firsts.len(), 2, "start does not rotate");
        let all = p.choose_for(&dl(-1, "a")).unwrap();
        assert_eq!(all.targets.len(), 3);
        assert_eq!(all.targets[2], 2, "the full target comes last");
        let start = DirLayout { start_target: Some(4), ..dl(2, "a") };
        assert_eq!(p.choose_for(&start).unwrap().targets, vec![4, 1]);
        // More stripes than targets online: capped, as Lustre does.
        assert_eq!(p.choose_for(&dl(4, "a")).unwrap().targets.len(), 3);
        assert_eq!(p.choose_for(&dl(1, "c")).unwrap_err().code, ErrorCode::Invalid);
        assert_eq!(p.choose_for(&dl(1, "b")).unwrap_err().code, ErrorCode::NoSpace);
    }
}
