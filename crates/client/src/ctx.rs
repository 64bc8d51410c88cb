//! Who asks (`Ctx`) and how a truncation was allowed (`Truncate`): what every part of the
//! client library takes from its caller.

/// How a truncation is allowed: by a permission check on the path (`truncate(2)`), through a
/// descriptor opened for writing (`ftruncate`: access was decided at open), or by the library
/// itself (an open with `O_TRUNC`, checked by the open).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truncate {
    CheckAccess,
    OpenForWrite,
    Checked,
}

/// The caller of an operation: whose permissions apply.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ctx {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

impl Ctx {
    /// The identity of this process.
    pub fn current() -> Ctx {
        // SAFETY: these calls have no preconditions and cannot fail.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let mut groups = vec![0 as libc::gid_t; 256];
        // SAFETY: the buffer holds 256 entries and its length is passed.
        let n = unsafe { libc::getgroups(groups.len() as i32, groups.as_mut_ptr()) };
        groups.truncate(n.max(0) as usize);
        Ctx { uid, gid, groups }
    }

    pub fn root() -> Ctx {
        Ctx::default()
    }
}
