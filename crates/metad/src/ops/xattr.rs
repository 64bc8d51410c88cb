//! `SetXattr`, `RemoveXattr`: extended attributes, bounded per inode.

use crate::error::show;
use crate::namespace::{check_xattr_name, Applied, MetaReply, Namespace, XATTR_TOTAL_MAX};
use crate::permission::{self, MAY_WRITE};
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::{RemoveXattr, SetXattr, XATTR_CREATE, XATTR_REPLACE};
use odfs_proto::{RequestHeader, Timespec, XATTR_VALUE_MAX};

impl Namespace {
    pub(crate) fn setxattr(&mut self, h: &RequestHeader, now: Timespec, req: &SetXattr) -> RpcResult<Applied> {
        if req.flags & !(XATTR_CREATE | XATTR_REPLACE) != 0 {
            return Err(RemoteError::new(
                ErrorCode::Invalid,
                format!("extended attribute flags {:#x} are invalid", req.flags),
            ));
        }
        check_xattr_name(&req.name)?;
        if req.value.len() > XATTR_VALUE_MAX {
            return Err(RemoteError::new(
                ErrorCode::Range,
                format!("extended attribute value is {} bytes; the limit is {XATTR_VALUE_MAX}", req.value.len()),
            ));
        }
        let node = self.node(req.ino)?;
        permission::require(h, node, req.ino, MAY_WRITE)?;
        let present = node.xattrs.contains_key(&req.name);
        if present && req.flags & XATTR_CREATE != 0 {
            return Err(RemoteError::new(
                ErrorCode::Exists,
                format!("extended attribute \"{}\" exists", show(&req.name)),
            ));
        }
        if !present && req.flags & XATTR_REPLACE != 0 {
            return Err(RemoteError::new(ErrorCode::NoData, format!("no extended attribute \"{}\"", show(&req.name))));
        }
        let used: usize = node.xattrs.iter().filter(|(k, _)| **k != req.name).map(|(k, v)| k.len() + v.len()).sum();
        if used + req.name.len() + req.value.len() > XATTR_TOTAL_MAX {
            return Err(RemoteError::new(
                ErrorCode::NoSpace,
                format!("inode {} would hold more than {XATTR_TOTAL_MAX} bytes of extended attributes", req.ino),
            ));
        }
        let node = self.node_mut(req.ino)?;
        node.xattrs.insert(req.name.clone(), req.value.clone());
        node.ctime = now;
        Applied::changed(MetaReply::Unit)
    }

    pub(crate) fn removexattr(&mut self, h: &RequestHeader, now: Timespec, req: &RemoveXattr) -> RpcResult<Applied> {
        check_xattr_name(&req.name)?;
        let node = self.node(req.ino)?;
        permission::require(h, node, req.ino, MAY_WRITE)?;
        let node = self.node_mut(req.ino)?;
        if node.xattrs.remove(&req.name).is_none() {
            return Err(RemoteError::new(ErrorCode::NoData, format!("no extended attribute \"{}\"", show(&req.name))));
        }
        node.ctime = now;
        Applied::changed(MetaReply::Unit)
    }
}
