//! Removals in flight: this client's name changes (unlink, rename, a batch of deferred
//! unlinks) whose replies may name a file they removed, for an open that metad answers "no
//! such inode" to wait for.
//!
//! A caching client keeps a file its own change removed a moment ago and answers opens of it
//! (`REMOVED_GRACE` in `fs`): the kernel may have resolved the old name just before the change.
//! Such an open goes to the inode's shard and the removal to the name's, so the open's "no such
//! inode" can arrive before the removal's reply has said which file went; the open then waits
//! for the removals begun before that answer and looks again, instead of failing with ESTALE.

use std::collections::BTreeSet;
use std::sync::Mutex;
use tokio::sync::Notify;

/// The removals of one client in flight, numbered in the order they began.
#[derive(Default)]
pub(crate) struct Removals {
    state: Mutex<State>,
    ended: Notify,
}

#[derive(Default)]
struct State {
    next: u64,
    live: BTreeSet<u64>,
}

/// One removal in flight; it ends when dropped (after its reply has been acted on).
pub(crate) struct Removal<'a> {
    of: &'a Removals,
    id: u64,
}

impl Removals {
    /// A removal begins.
    pub(crate) fn begin(&self) -> Removal<'_> {
        let mut s = self.state.lock().expect("removals lock");
        let id = s.next;
        s.next += 1;
        s.live.insert(id);
        Removal { of: self, id }
    }

    /// Marks now: the removals begun before it are those `settled` waits for.
    pub(crate) fn mark(&self) -> u64 {
        self.state.lock().expect("removals lock").next
    }

    /// Waits until every removal begun before `mark` has ended.
    pub(crate) async fn settled(&self, mark: u64) {
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            // Registered before the check: an end between the check and the wait is not missed.
            ended.as_mut().enable();
            if self.state.lock().expect("removals lock").live.first().is_none_or(|&id| id >= mark) {
                return;
            }
            ended.await;
        }
    }
}

impl Drop for Removal<'_> {
    fn drop(&mut self) {
        self.of.state.lock().expect("removals lock").live.remove(&self.id);
        self.of.ended.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[test]
    fn an_open_waits_for_the_removals_begun_before_its_mark_and_no_others() {
        let r = Removals::default();
        let (first, second) = (r.begin(), r.begin());
        let mark = r.mark();
        let later = r.begin();
        let mut wait = Box::pin(r.settled(mark));
        assert!(wait.as_mut().now_or_never().is_none(), "two removals before the mark are in flight");
        drop(second);
        assert!(wait.as_mut().now_or_never().is_none(), "one removal before the mark is in flight");
        drop(first);
        assert!(wait.as_mut().now_or_never().is_some(), "a removal begun after the mark holds nothing");
        drop(later);
        assert!(r.settled(r.mark()).now_or_never().is_some(), "nothing in flight");
    }
}
