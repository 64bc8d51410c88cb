//! Requests answered on the reader thread that read them, with a round trip if need be.
//!
//! A metadata request that misses the caches (create, unlink, lookup of a new name, ...) is
//! one round trip to metad. Run as a task on the adapter's runtime it also costs two thread
//! hand-offs: the reader wakes a runtime worker, and the connection's reader task wakes the
//! caller when the reply comes. Here the reader thread drives the request itself on a
//! current-thread runtime of its own, over connections of its own (a lane of the client's
//! connection pool), so the reply wakes the thread that waits for it, as a libfuse
//! filesystem's handler thread waits for its own system call. A request runs here only if
//! all its work ends with its reply: anything that keeps going after it (read-ahead,
//! write-behind, a release) is spawned on the client's own runtime, never on this one,
//! which runs only while the thread serves a request.

use std::cell::OnceCell;
use std::future::Future;

thread_local! {
    static RUNTIME: OnceCell<tokio::runtime::Runtime> = const { OnceCell::new() };
}

/// Runs `work` to its end on this thread (its runtime made, and its lane taken, at the
/// thread's first request).
pub(crate) fn block_on<T>(work: impl Future<Output = T>) -> T {
    RUNTIME.with(|rt| {
        let rt = rt.get_or_init(|| {
            odfs_client::own_lane();
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread runtime needs no resources that can be missing")
        });
        rt.block_on(work)
    })
}
