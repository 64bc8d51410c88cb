//! Frozen numeric method ids and the typed request trait.
//!
//! Ranges: 1–99 mgmtd, 100–199 metad, 200–299 stored, 300–399 stage agents, 400–499 every
//! service (statistics). A retired id is never reused.

use crate::codec::Payload;
use serde::{de::DeserializeOwned, Serialize};

/// A request type: its frozen method id and the type of its successful reply.
pub trait Rpc: Serialize + DeserializeOwned + Send + Sync + 'static {
    const METHOD: u16;
    const NAME: &'static str;
    type Reply: Serialize + DeserializeOwned + Send + Sync + 'static;

    /// The request's bulk bytes (a chunk write's data), if it has any: sent after the encoded
    /// request as buffers of their own, shared rather than copied (a retry sends them again),
    /// and received into one that becomes the request's (see `codec`).
    fn payload(&self) -> Option<&Payload> {
        None
    }

    /// Where a received request's payload goes; `None` for requests that carry none.
    fn payload_mut(&mut self) -> Option<&mut Payload> {
        None
    }

    /// The reply's bulk bytes (chunk data), if it has any: sent after the encoded reply as a
    /// buffer of their own and received into one that becomes the reply's, so they are never
    /// copied into or out of a frame (see `codec`).
    fn reply_payload(_reply: &mut Self::Reply) -> Option<&mut Vec<u8>> {
        None
    }

    /// The reply's bulk bytes still in files (a chunk read's), sent after `reply_payload`'s
    /// by the transport straight from the files (see `codec::FileSpan`); the receiver gets
    /// them in `reply_payload`'s buffer. Send side only.
    fn reply_spans(_reply: &mut Self::Reply) -> Option<&mut Vec<crate::codec::FileSpan>> {
        None
    }

    /// The storage target a request is for, if any: `GetStats` also counts requests and bytes
    /// per target.
    fn stats_target(&self) -> Option<crate::TargetId> {
        None
    }

    /// The inodes a metadata request reads or changes by id, the directories it names a child
    /// of included: metad recalls another client's create delegation on any of them before it
    /// answers (docs/architecture.md, "Create delegations"). Requests about a file by id alone
    /// (sizes, layouts) name none: only the delegation's holder knows a file it has not sent.
    fn inodes(&self) -> Vec<crate::InodeId> {
        Vec::new()
    }
}

/// Declares the method id and reply type of request types; a `{ ... }` after the reply type
/// adds items to the `Rpc` impl (e.g. `payload` and `reply_payload`).
#[macro_export]
macro_rules! rpc {
    ($( $req:ident = $id:expr => $reply:ty $({ $($item:item)* })? ),* $(,)?) => {
        $(
            impl $crate::method::Rpc for $req {
                const METHOD: u16 = $id;
                const NAME: &'static str = stringify!($req);
                type Reply = $reply;
                $($($item)*)?
            }
        )*
        /// Every method id declared in this module, for the uniqueness test.
        pub const METHOD_IDS: &[u16] = &[$($id),*];
    };
}
