//! The FUSE-over-io_uring minimum: the striped large files of [`crate::minimum`] served through
//! the kernel's io_uring transport for FUSE (kernel 6.14+, `enable_uring`) instead of reads
//! and writes of `/dev/fuse`, so that the least a default-striped 4 KiB read costs through FUSE
//! is measured with the cheapest transport this kernel has, not only with fuser's.
//!
//! fuser has no io_uring transport, so this speaks the protocol itself, for the few requests a
//! read-only tree of large files needs (LOOKUP, GETATTR, OPEN, READ, RELEASE and what the
//! kernel asks around them). One thread per CPU queue owns an io_uring with one ring entry per
//! request it may hold; a READ never leaves that thread: one chunk in four (this node's) is an
//! `O_DIRECT` read of the plain directory's file straight into the entry's payload buffer, the
//! other three a request to the [`FileServer`] and its bytes received into that same buffer,
//! each submitted on the same ring as the reply and the fetch of the next request. Before the
//! ring is ready (and for FORGET and INTERRUPT, which never use it) requests arrive on
//! `/dev/fuse` and are answered there.
//!
//! For measuring by hand, the same files can instead be a running odfs's (`UringSource::Odfs`):
//! each READ is then a task of a runtime of odfs-fuse's shape reading through odfs's client
//! library, its bytes copied into the entry's payload and the queue's thread woken by an
//! eventfd on its ring to answer: odfs's read path as it is, under this transport. With
//! `direct`, a READ within one chunk is instead asked of its stored by the queue's thread
//! itself, on the ring: its `ReadChunk` request sent on the queue's authenticated bulk stream
//! to that stored (one per target, multiplexed: see `Streams`), the reply's bytes copied into
//! the entry's payload buffer — odfs's stored and wire, with the chunk exchange where the
//! striped minimum has it.

use crate::abi::{self, op, InitOut, Op, Request};
use crate::fs::{MAX_BACKGROUND, MAX_WRITE};
use crate::minimum::{connect, local_chunk, range_request, FileServer};
use crate::ring::{
    possible_cpus, push, ring_cmd, AlignedBuf, CMD_COMMIT_AND_FETCH, CMD_REGISTER, ENT_COMMIT_ID, ENT_PAYLOAD_SZ,
    OP_IN, PAGE, RING_HEADER,
};
use io_uring::{opcode, squeue, types, IoUring};
use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Longest READ the mount asks for (FUSE's `max_pages` 256 = 1 MiB, odfs-fuse's `MAX_WRITE`),
/// the size of a ring entry's payload buffer.
const MAX_IO: usize = MAX_WRITE as usize;
/// TTL of every entry and attribute reply (the tree never changes).
const TTL_SECS: u64 = 3600;

/// What [`mount`] serves, and how many ring entries per queue.
pub struct UringSpec {
    pub source: UringSource,
    /// Ring entries (requests held at once) per CPU queue.
    pub entries: usize,
}

/// Where the files `/seq.{k}.0`' bytes come from.
pub enum UringSource {
    /// Striped as the default layout stripes them, seen from one of four nodes.
    Striped {
        /// Where file `k`'s chunks on other nodes are fetched from (over TCP).
        remote: Vec<PathBuf>,
        /// Where file `k`'s chunks on this node are read from (`O_DIRECT`); as many as `remote`.
        disk: Vec<PathBuf>,
        /// Size of each file.
        size: u64,
    },
    /// The files `{dir}/seq.{k}.0` (`k < files`) of a running odfs (its client config `fs`), read
    /// through odfs's client library as odfs-fuse reads them (tasks on a runtime of two
    /// workers): what odfs's own read path would do under this transport. `direct`: READs
    /// within one chunk are asked of stored by the queue's thread on its ring instead.
    Odfs { fs: PathBuf, dir: String, files: usize, direct: bool },
}

/// A mounted io_uring minimum: unmounted (and its threads joined) by [`UringMount::unmount`].
pub struct UringMount {
    at: PathBuf,
    dev: RawFd,
    dev_thread: JoinHandle<()>,
    queues: Vec<JoinHandle<Served>>,
    _server: Option<FileServer>,
    /// The odfs client's runtime (`UringSource::Odfs`), dropped once every thread has ended.
    runtime: Option<tokio::runtime::Runtime>,
}

/// What every thread shares: the tree and where its bytes come from.
struct Tree {
    dev: RawFd,
    /// Per file, its size.
    sizes: Vec<u64>,
    bytes: Bytes,
}

/// Where READs are answered from.
enum Bytes {
    Striped {
        /// Per file: an `O_DIRECT` descriptor of the plain directory's file.
        direct: Vec<File>,
        /// Per file: a buffered descriptor of it (READs answered on `/dev/fuse`).
        buffered: Vec<File>,
        /// Per file: the [`FileServer`] port serving it.
        addrs: Vec<SocketAddr>,
    },
    Odfs {
        rt: tokio::runtime::Handle,
        files: Vec<Arc<odfs_client::FileHandle>>,
        /// The client whose bulk streams direct reads use (`direct`).
        direct: Option<odfs_client::Client>,
    },
}

/// Mounts the minimum at `at` and serves it from threads of this process until unmounted.
/// Fails when the kernel offers no io_uring transport (`enable_uring` off, or too old).
pub fn mount(spec: &UringSpec, at: &Path) -> std::io::Result<UringMount> {
    if spec.entries == 0 {
        return Err(std::io::Error::other("the io_uring minimum needs ring entries"));
    }
    let queue_count = possible_cpus()?;
    let (sizes, bytes, server, runtime) = match &spec.source {
        UringSource::Striped { remote, disk, size } => {
            let (sizes, bytes, server) = striped(remote, disk, *size)?;
            (sizes, bytes, Some(server), None)
        }
        UringSource::Odfs { fs, dir, files, direct } => {
            let (sizes, bytes, rt) = odfs_files(fs, dir, *files, *direct)?;
            (sizes, bytes, None, Some(rt))
        }
    };
    let dev = mount_fuse(at)?;
    let tree = Arc::new(Tree { dev, sizes, bytes });
    let refused = match init(&tree) {
        Ok(offered) if offered & abi::init::OVER_IO_URING != 0 => None,
        Ok(_) => Some(std::io::Error::other(format!(
            "the kernel offers no FUSE io_uring transport ({ENABLE_URING} is not Y, or the kernel is older than 6.14)"
        ))),
        Err(e) => Some(e),
    };
    if let Some(e) = refused {
        let _ = unmount_at(at);
        // SAFETY: the descriptor `mount_fuse` opened, used by no thread.
        unsafe { libc::close(dev) };
        return Err(e);
    }
    let t = tree.clone();
    let dev_thread = std::thread::Builder::new().name("fuse-dev".into()).spawn(move || serve_dev(&t))?;
    // Every CPU's queue must be registered before any request uses the rings.
    let mut queues = Vec::new();
    for qid in 0..queue_count {
        let (t, entries) = (tree.clone(), spec.entries);
        queues.push(std::thread::Builder::new().name(format!("fuse-ring-{qid}")).spawn(move || {
            let mut answered = Served::default();
            if let Err(e) = serve_queue(&t, qid as u16, entries, &mut answered) {
                eprintln!("odfs fuse-minimum: io_uring queue {qid}: {e}");
            }
            answered
        })?);
    }
    crate::mount::tune_readahead(&at.canonicalize()?);
    Ok(UringMount { at: at.to_path_buf(), dev, dev_thread, queues, _server: server, runtime })
}

/// The striped source's files: their sizes, descriptors and the server of their remote chunks.
fn striped(remote: &[PathBuf], disk: &[PathBuf], size: u64) -> std::io::Result<(Vec<u64>, Bytes, FileServer)> {
    if remote.len() != disk.len() || disk.is_empty() {
        return Err(std::io::Error::other("the io_uring minimum needs as many remote as disk files"));
    }
    let server = FileServer::start(remote)?;
    let (mut direct, mut buffered) = (Vec::new(), Vec::new());
    for f in disk {
        direct.push(std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(f)?);
        buffered.push(File::open(f)?);
    }
    let bytes = Bytes::Striped { direct, buffered, addrs: server.addrs().to_vec() };
    Ok((vec![size; disk.len()], bytes, server))
}

/// The odfs source's files, opened for reading through a client of the filesystem `fs` (as
/// root), with the runtime its reads run on.
fn odfs_files(
    fs: &Path,
    dir: &str,
    count: usize,
    direct: bool,
) -> std::io::Result<(Vec<u64>, Bytes, tokio::runtime::Runtime)> {
    use odfs_client::{Client, ClientConfig, Ctx};
    let err = |e: odfs_client::ClientError| std::io::Error::other(e.to_string());
    // One-shot: it takes no leases, which would make other clients' changes wait for it
    // after it has gone (a lease outlives its holder by up to the lease time).
    let cfg = ClientConfig::load(fs).map_err(err)?.one_shot();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(crate::mount::RUNTIME_WORKERS)
        .thread_name("odfs-fuse-rt")
        .enable_all()
        .build()?;
    let (sizes, files, client) = rt
        .block_on(async {
            let client = Client::connect(cfg.clone()).await?;
            client.register(cfg.node).await?;
            let (mut sizes, mut files) = (Vec::new(), Vec::new());
            for k in 0..count {
                let attr =
                    client.resolve(&Ctx::root(), &format!("{}/seq.{k}.0", dir.trim_end_matches('/')), true).await?;
                sizes.push(attr.size);
                files.push(Arc::new(client.open(&Ctx::root(), attr.ino, true, false, false).await?));
            }
            Ok::<_, odfs_client::ClientError>((sizes, files, client))
        })
        .map_err(err)?;
    let bytes = Bytes::Odfs { rt: rt.handle().clone(), files, direct: direct.then_some(client) };
    Ok((sizes, bytes, rt))
}

/// What a mount's rings answered.
#[derive(Debug, Default, Clone, Copy)]
pub struct Served {
    /// Requests.
    pub requests: u64,
    /// READs of the odfs source answered with the bytes of stored's replies, asked and
    /// received on the rings themselves (`direct`).
    pub from_stored: u64,
}

impl UringMount {
    /// Unmounts and waits for every serving thread. Returns what the rings answered (the rest
    /// came on `/dev/fuse`).
    pub fn unmount(self) -> std::io::Result<Served> {
        let r = unmount_at(&self.at);
        let _ = self.dev_thread.join();
        let answered = self.queues.into_iter().map(|q| q.join().unwrap_or_default()).fold(Served::default(), |a, b| {
            Served { requests: a.requests + b.requests, from_stored: a.from_stored + b.from_stored }
        });
        // SAFETY: the descriptor `mount_fuse` opened; every thread using it has ended.
        unsafe { libc::close(self.dev) };
        if let Some(rt) = self.runtime {
            rt.shutdown_background();
        }
        r.map(|()| answered)
    }
}

/// The kernel's switch for FUSE's io_uring transport: a FUSE daemon may ask for it only while
/// this is `Y` (it changes nothing for daemons that do not ask, as fuser's do not).
pub const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// Where users of [`TransportAllowed`] on this machine meet: the first file is held exclusively
/// while the switch is changed and holds its value from before the first user; the second is
/// held shared by every user for as long as it needs the transport.
const SWITCH_LOCK: &str = "/tmp/.odfs-fuse-uring.switch";
const USERS_LOCK: &str = "/tmp/.odfs-fuse-uring.users";

/// The io_uring transport allowed for as long as this lives (`ENABLE_URING` set to `Y`), and
/// the switch put back as it was when the last such guard on the machine is dropped (a
/// benchmark and tests may hold one at once, in processes of their own).
pub struct TransportAllowed {
    switch: File,
    users: File,
}

impl TransportAllowed {
    /// Allows the transport; fails when this kernel has none (no `ENABLE_URING`) or it cannot
    /// be switched on (not root).
    pub fn new() -> std::io::Result<TransportAllowed> {
        let open = |p| std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(p);
        let (switch, users) = (open(SWITCH_LOCK)?, open(USERS_LOCK)?);
        flock(&switch, libc::LOCK_EX)?;
        flock(&users, libc::LOCK_SH)?;
        let allowed = Self::switch_on(&switch);
        flock(&switch, libc::LOCK_UN)?;
        allowed.map(|()| TransportAllowed { switch, users })
    }

    /// Sets the switch to `Y`, keeping what it was in `switch` unless a user before did.
    fn switch_on(switch: &File) -> std::io::Result<()> {
        let was = std::fs::read_to_string(ENABLE_URING).map_err(|e| {
            std::io::Error::new(e.kind(), format!("this kernel has no FUSE io_uring transport ({ENABLE_URING}: {e})"))
        })?;
        if was.trim() == "Y" {
            return Ok(());
        }
        std::fs::write(ENABLE_URING, "Y")
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot allow FUSE io_uring ({ENABLE_URING}: {e})")))?;
        switch.set_len(0)?;
        switch.write_all_at(was.trim().as_bytes(), 0)
    }
}

impl Drop for TransportAllowed {
    fn drop(&mut self) {
        if flock(&self.switch, libc::LOCK_EX).is_err() {
            return;
        }
        // The last user (no other holds `users`) puts the switch back and forgets its value.
        if flock(&self.users, libc::LOCK_EX | libc::LOCK_NB).is_ok() {
            let mut was = String::new();
            if self.switch.read_to_string(&mut was).is_ok() && !was.is_empty() {
                let _ = std::fs::write(ENABLE_URING, was.trim());
                let _ = self.switch.set_len(0);
            }
        }
    }
}

fn flock(f: &File, how: i32) -> std::io::Result<()> {
    // SAFETY: flock(2) on an open descriptor.
    if unsafe { libc::flock(f.as_raw_fd(), how) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Opens `/dev/fuse` and mounts a read-only FUSE filesystem on it at `at`.
fn mount_fuse(at: &Path) -> std::io::Result<RawFd> {
    let dev = std::fs::OpenOptions::new().read(true).write(true).open("/dev/fuse")?;
    let fd = dev.as_raw_fd();
    let opts = format!("fd={fd},rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other");
    let c = |s: &str| CString::new(s).map_err(std::io::Error::other);
    let (src, target, fstype, data) =
        (c("odfs-minimum")?, c(&at.to_string_lossy())?, c("fuse.odfs-minimum")?, c(&opts)?);
    // SAFETY: every pointer is a NUL-terminated string alive for the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
            data.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // The descriptor lives as long as the mount's serving threads (the process).
    Ok(std::os::fd::IntoRawFd::into_raw_fd(dev))
}

fn unmount_at(at: &Path) -> std::io::Result<()> {
    let target = CString::new(at.to_string_lossy().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: a NUL-terminated path alive for the call.
    if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// Reads INIT from `/dev/fuse` and answers it, asking for the io_uring transport where the
/// kernel offers it. Returns the flags the kernel offered.
fn init(tree: &Tree) -> std::io::Result<u64> {
    let mut buf = vec![0u8; MAX_IO + PAGE];
    // SAFETY: `buf` is writable for its length; the descriptor is open.
    let n = unsafe { libc::read(tree.dev, buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let req = Request::parse(&buf[..n as usize]).map_err(std::io::Error::other)?;
    let Op::Init { minor, max_readahead, flags: offered, .. } = req.op else {
        return Err(std::io::Error::other(format!("expected INIT from the kernel, got opcode {}", req.header.opcode)));
    };
    use abi::init::*;
    let want = ASYNC_READ | BIG_WRITES | ASYNC_DIO | MAX_PAGES | INIT_EXT | OVER_IO_URING;
    // As odfs-fuse asks (`fs::ask_io`): as many background requests in flight, as large WRITEs.
    let reply = InitOut {
        major: 7,
        minor,
        max_readahead,
        flags: offered & want,
        max_background: MAX_BACKGROUND,
        congestion_threshold: MAX_BACKGROUND / 4 * 3,
        max_write: MAX_WRITE,
        time_gran: 1,
        max_pages: (MAX_IO / PAGE) as u16,
        max_stack_depth: 0,
    };
    let mut out = [0u8; abi::OUT_HEADER + abi::INIT_OUT];
    let len = reply.encode(&mut out[abi::OUT_HEADER..]);
    out[..abi::OUT_HEADER].copy_from_slice(&abi::out_header(req.header.unique, len, 0));
    // SAFETY: `out` holds the reply; the descriptor is open.
    if unsafe { libc::write(tree.dev, out.as_ptr().cast(), out.len()) } != out.len() as isize {
        return Err(std::io::Error::last_os_error());
    }
    Ok(offered)
}

/// A request's answer: done (`error`, and `len` bytes of out arguments written), or a READ of
/// file `k` still to be fetched.
enum Answer {
    Done { error: i32, len: usize },
    Read { k: usize, offset: u64, len: usize },
}

/// The node a file's inode is: root 1, file `k` is `2 + k`.
fn file_of(tree: &Tree, ino: u64) -> Option<usize> {
    (ino >= 2 && ((ino - 2) as usize) < tree.sizes.len()).then(|| (ino - 2) as usize)
}

/// The attributes of inode `ino`.
fn attr_of(tree: &Tree, ino: u64) -> abi::Attr {
    let (size, mode, nlink) = match file_of(tree, ino) {
        Some(k) => (tree.sizes[k], libc::S_IFREG | 0o444, 1),
        None => (0, libc::S_IFDIR | 0o555, 2),
    };
    abi::Attr { ino, size, blocks: size.div_ceil(512), mode, nlink, blksize: PAGE as u32, ..abi::Attr::default() }
}

/// Answers request `req`; out arguments go into `out`.
fn answer(tree: &Tree, req: &Request<'_>, out: &mut [u8]) -> Answer {
    let done = |len| Answer::Done { error: 0, len };
    let fail = |e: i32| Answer::Done { error: -e, len: 0 };
    let ino = req.header.nodeid;
    match req.op {
        Op::Lookup { name } => {
            let k = name
                .to_str()
                .and_then(|n| n.strip_prefix("seq.")?.strip_suffix(".0")?.parse::<usize>().ok())
                .filter(|&k| ino == 1 && k < tree.sizes.len());
            let Some(k) = k else { return fail(libc::ENOENT) };
            done(abi::entry_out(out, &attr_of(tree, 2 + k as u64), 0, Duration::from_secs(TTL_SECS)))
        }
        Op::Getattr { .. } => {
            if ino != 1 && file_of(tree, ino).is_none() {
                return fail(libc::ENOENT);
            }
            done(abi::attr_out(out, &attr_of(tree, ino), Duration::from_secs(TTL_SECS)))
        }
        Op::Open { .. } => done(abi::open_out(out, 0, abi::FOPEN_KEEP_CACHE, 0)),
        Op::Opendir { .. } => done(abi::open_out(out, 0, 0, 0)),
        Op::Read { offset, size, .. } => {
            let Some(k) = file_of(tree, ino) else { return fail(libc::EISDIR) };
            let len = (size as u64).min(tree.sizes[k].saturating_sub(offset)) as usize;
            if len == 0 {
                return done(0);
            }
            Answer::Read { k, offset, len }
        }
        Op::Readdir { .. } => done(0),
        Op::Statfs => done(
            abi::Statfs { bsize: PAGE as u32, namelen: 255, frsize: PAGE as u32, ..Default::default() }.encode(out),
        ),
        Op::Release { .. } | Op::Releasedir { .. } | Op::Flush { .. } | Op::Destroy => done(0),
        _ => fail(libc::ENOSYS),
    }
}

/// Answers what arrives on `/dev/fuse` (everything before the rings are ready; FORGET and
/// INTERRUPT always) until the connection ends. READs here are fetched synchronously.
fn serve_dev(tree: &Tree) {
    let mut buf = vec![0u8; MAX_IO + PAGE];
    let mut out = AlignedBuf::new(16 + MAX_IO);
    let mut conns: Vec<Option<TcpStream>> = tree.sizes.iter().map(|_| None).collect();
    loop {
        // SAFETY: `buf` is writable for its length; the descriptor stays open.
        let n = unsafe { libc::read(tree.dev, buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::ENOENT) => continue,
                _ => return,
            }
        }
        let req = match Request::parse(&buf[..n as usize]) {
            Ok(req) => req,
            // Arguments the protocol does not allow: EIO for that request, the rest served.
            Err(_) => match abi::InHeader::parse(&buf[..n as usize]) {
                Ok(h) => {
                    let head = abi::out_header(h.unique, 0, libc::EIO);
                    // SAFETY: `head` holds the reply; the descriptor stays open.
                    let _ = unsafe { libc::write(tree.dev, head.as_ptr().cast(), head.len()) };
                    continue;
                }
                Err(_) => return,
            },
        };
        if matches!(req.header.opcode, op::FORGET | op::BATCH_FORGET | op::INTERRUPT) {
            continue;
        }
        let body = out.as_mut_slice();
        let (error, len) = match answer(tree, &req, &mut body[16..]) {
            Answer::Done { error, len } => (error, len),
            Answer::Read { k, offset, len } => match fetch_sync(tree, &mut conns, k, offset, &mut body[16..16 + len]) {
                Ok(()) => (0, len),
                Err(e) => (-e.raw_os_error().unwrap_or(libc::EIO), 0),
            },
        };
        body[..16].copy_from_slice(&abi::out_header(req.header.unique, len, -error));
        // SAFETY: `body` holds the reply's bytes; the descriptor stays open.
        let _ = unsafe { libc::write(tree.dev, body.as_ptr().cast(), 16 + len) };
    }
}

/// A READ's bytes fetched without the ring (the `/dev/fuse` path).
fn fetch_sync(
    tree: &Tree,
    conns: &mut [Option<TcpStream>],
    k: usize,
    offset: u64,
    into: &mut [u8],
) -> std::io::Result<()> {
    let (buffered, addrs) = match &tree.bytes {
        Bytes::Striped { buffered, addrs, .. } => (buffered, addrs),
        Bytes::Odfs { rt, files, .. } => {
            let got = rt
                .block_on(files[k].read(offset, into.len() as u32))
                .map_err(|_| std::io::Error::from_raw_os_error(libc::EIO))?;
            if got.len() != into.len() {
                return Err(std::io::Error::from_raw_os_error(libc::EIO));
            }
            into.copy_from_slice(&got);
            return Ok(());
        }
    };
    if local_chunk(offset) {
        // Buffered (the reply's bytes start 16 bytes into its buffer): rare, before the rings.
        return buffered[k].read_exact_at(into, offset);
    }
    let conn = match &mut conns[k] {
        Some(c) => c,
        slot => slot.insert(connect(addrs[k])?),
    };
    conn.write_all(&range_request(offset, into.len()))?;
    conn.read_exact(into)
}

/// One ring entry: its header and payload buffers (registered with the kernel), the iovecs
/// naming them, its connections to the file servers, and the range request being sent.
struct Entry {
    header: AlignedBuf,
    payload: AlignedBuf,
    iov: [libc::iovec; 2],
    conns: Vec<Option<TcpStream>>,
    request: [u8; 16],
    /// Bytes the READ in progress asked for.
    want: usize,
    /// The file whose connection the READ in progress uses, if it is fetched over TCP.
    fetching: Option<usize>,
}

/// What a completion is for (low bits of its `user_data`; the entry index above them).
const FETCHED: u64 = 0;
const SENT: u64 = 1;
const FILLED: u64 = 2;
/// The queue's eventfd was written: READs done on the odfs client's runtime wait in `Done`.
const WOKEN: u64 = 3;
/// A direct read stream's send, and its receive, completed (the stream index above them).
const STREAM_SENT: u64 = 4;
const STREAM_RECEIVED: u64 = 5;

/// READs of the odfs source finished on the runtime, for the queue's thread to answer: the
/// entry and its byte count or -errno, and the eventfd that wakes the thread.
struct Done {
    finished: std::sync::Mutex<Vec<(usize, i32)>>,
    efd: RawFd,
}

impl Drop for Done {
    fn drop(&mut self) {
        // SAFETY: the eventfd this owns; no task holds `Done` any more.
        unsafe { libc::close(self.efd) };
    }
}

/// A payload buffer's address, handed to the runtime task that fills it (the entry is its
/// until the task reports through `Done`; the ring thread does not touch it meanwhile).
struct PayloadPtr(*mut u8);
// SAFETY: see above: one writer at a time, and the buffer outlives the mount's threads.
unsafe impl Send for PayloadPtr {}

fn tag(entry: usize, what: u64) -> u64 {
    ((entry as u64) << 3) | what
}

/// Serves CPU queue `qid` with `entries` ring entries until the connection ends, counting the
/// requests it answered in `answered`.
fn serve_queue(tree: &Tree, qid: u16, entries: usize, answered: &mut Served) -> std::io::Result<()> {
    let mut ring: IoUring<squeue::Entry128> =
        IoUring::builder().setup_single_issuer().setup_defer_taskrun().build((entries * 4) as u32)?;
    let mut ents: Vec<Entry> = (0..entries)
        .map(|_| Entry {
            header: AlignedBuf::new(RING_HEADER),
            payload: AlignedBuf::new(MAX_IO),
            iov: [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 2],
            conns: tree.sizes.iter().map(|_| None).collect(),
            request: [0; 16],
            want: 0,
            fetching: None,
        })
        .collect();
    for (i, e) in ents.iter_mut().enumerate() {
        e.iov = [
            libc::iovec { iov_base: e.header.ptr.cast(), iov_len: RING_HEADER },
            libc::iovec { iov_base: e.payload.ptr.cast(), iov_len: MAX_IO },
        ];
        let sqe = ring_cmd(tree.dev, CMD_REGISTER, 0, qid, Some(e.iov.as_ptr() as u64)).user_data(tag(i, FETCHED));
        push(&mut ring, &sqe)?;
    }
    // SAFETY: eventfd(2) has no memory preconditions.
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if efd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let done = Arc::new(Done { finished: std::sync::Mutex::new(Vec::new()), efd });
    let mut counter = [0u8; 8];
    let wake_sqe = |counter: &mut [u8; 8]| {
        squeue::Entry128::from(
            opcode::Read::new(types::Fd(efd), counter.as_mut_ptr(), 8).build().user_data(tag(0, WOKEN)),
        )
    };
    if matches!(tree.bytes, Bytes::Odfs { .. }) {
        push(&mut ring, &wake_sqe(&mut counter))?;
    }
    let mut streams = Streams::default();
    ring.submit()?;
    loop {
        match ring.submit_and_wait(1) {
            // A signal, or completions to reap before more can be submitted: go on.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY)) => {}
            r => drop(r?),
        }
        let completions: Vec<(u64, i32)> = ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (data, res) in completions {
            let (i, what) = ((data >> 3) as usize, data & 7);
            let next = match what {
                FETCHED if res < 0 => {
                    // The connection ended (unmount) or the kernel refused the entry.
                    answered.from_stored = streams.read;
                    return match -res {
                        libc::ENOTCONN | libc::ENODEV | libc::ECANCELED => Ok(()),
                        e => Err(std::io::Error::from_raw_os_error(e)),
                    };
                }
                FETCHED => {
                    answered.requests += 1;
                    on_request(tree, qid, i, &mut ents[i], &done, &mut streams)
                }
                WOKEN => {
                    let finished = std::mem::take(&mut *done.finished.lock().expect("done lock"));
                    let mut next = vec![wake_sqe(&mut counter)];
                    for (i, res) in finished {
                        next.extend(filled(tree, qid, i, &mut ents[i], res));
                    }
                    next
                }
                // A failed send fails its linked receive too, which answers the READ.
                SENT => continue,
                STREAM_SENT => streams.sent(i, res, tree, qid, &mut ents),
                STREAM_RECEIVED => streams.received(i, res, tree, qid, &mut ents),
                _ => filled(tree, qid, i, &mut ents[i], res),
            };
            for sqe in next {
                push(&mut ring, &sqe)?;
            }
        }
        // The requests this round asked of stored, sent together per stream.
        for sqe in streams.flush() {
            push(&mut ring, &sqe)?;
        }
    }
}

/// Entry `i`'s READ bytes arrived (`res` of them, or -errno): answers the READ. A fetch that
/// failed or came short (the server closes at a range past its file's end) is an EIO, and its
/// connection is dropped; a disk read comes short only at the file's end.
fn filled(tree: &Tree, qid: u16, i: usize, e: &mut Entry, res: i32) -> Vec<squeue::Entry128> {
    let fetched = e.fetching.take();
    let failed = res < 0 || (fetched.is_some() && (res as usize) < e.want);
    if failed {
        if let Some(k) = fetched {
            e.conns[k] = None;
        }
        let errno = if res < 0 && res != -libc::ECANCELED { -res } else { libc::EIO };
        return commit(tree, qid, i, e, errno, 0);
    }
    let n = (res as usize).min(e.want);
    commit(tree, qid, i, e, 0, n)
}

/// A request arrived in entry `i`: answered at once (its commit), or its READ started.
fn on_request(
    tree: &Tree,
    qid: u16,
    i: usize,
    e: &mut Entry,
    done: &Arc<Done>,
    streams: &mut Streams,
) -> Vec<squeue::Entry128> {
    let (header, payload) = (e.header.as_slice(), e.payload.as_slice());
    let payload_sz = u32_at(header, ENT_PAYLOAD_SZ) as usize;
    let (op_in, rest) = (&header[OP_IN..2 * OP_IN], &payload[..payload_sz.min(MAX_IO)]);
    let mut out = [0u8; 256];
    let reply = match Request::parse_parts(&header[..abi::IN_HEADER], op_in, rest) {
        Ok(req) => answer(tree, &req, &mut out),
        Err(_) => Answer::Done { error: -libc::EIO, len: 0 },
    };
    match reply {
        Answer::Done { error, len } => {
            e.payload.as_mut_slice()[..len].copy_from_slice(&out[..len]);
            commit(tree, qid, i, e, -error, len)
        }
        Answer::Read { k, offset, len } => {
            e.want = len;
            let (direct, buffered, addrs) = match &tree.bytes {
                Bytes::Striped { direct, buffered, addrs } => (direct, buffered, addrs),
                Bytes::Odfs { rt, files, direct } => {
                    if let Some(client) = direct {
                        if streams.ask(rt, client, &files[k], offset, len, i).is_some() {
                            return Vec::new();
                        }
                    }
                    read_on_runtime(rt, files[k].clone(), offset, len, i, PayloadPtr(e.payload.ptr), done.clone());
                    return Vec::new();
                }
            };
            if local_chunk(offset) {
                // Into the page-aligned payload: O_DIRECT wherever the offset allows (its length
                // rounded up to a page; the file's end makes it short), else buffered.
                let (fd, want) = if offset.is_multiple_of(PAGE as u64) {
                    (direct[k].as_raw_fd(), len.next_multiple_of(PAGE))
                } else {
                    (buffered[k].as_raw_fd(), len)
                };
                let sqe = opcode::Read::new(types::Fd(fd), e.payload.ptr, want as u32)
                    .offset(offset)
                    .build()
                    .user_data(tag(i, FILLED));
                return vec![sqe.into()];
            }
            let fd = match &mut e.conns[k] {
                Some(c) => c.as_raw_fd(),
                slot => match connect(addrs[k]) {
                    Ok(c) => slot.insert(c).as_raw_fd(),
                    Err(err) => return commit(tree, qid, i, e, err.raw_os_error().unwrap_or(libc::EIO), 0),
                },
            };
            e.request = range_request(offset, len);
            e.fetching = Some(k);
            let send = opcode::Send::new(types::Fd(fd), e.request.as_ptr(), 16)
                .build()
                .flags(squeue::Flags::IO_LINK)
                .user_data(tag(i, SENT));
            let recv = opcode::Recv::new(types::Fd(fd), e.payload.ptr, len as u32)
                .flags(libc::MSG_WAITALL)
                .build()
                .user_data(tag(i, FILLED));
            vec![send.into(), recv.into()]
        }
    }
}

/// A queue's direct reads (`UringSource::Odfs` with `direct`): one bulk stream per stored
/// target, multiplexed as odfs's client multiplexes its connections: the requests a round of
/// completions asks for are sent together, one send per stream, and one receive per stream
/// takes whatever replies have arrived, each copied into the payload buffer of the entry whose
/// call it answers.
#[derive(Default)]
struct Streams {
    header: Option<odfs_proto::RequestHeader>,
    by_target: std::collections::HashMap<odfs_proto::TargetId, usize>,
    /// Every stream made, by index (a failed one is kept, dead, until the queue ends: the ring
    /// may still hold its buffers).
    all: Vec<Stream>,
    next_call: u64,
    /// READs answered with the bytes of stored's reply.
    read: u64,
}

struct Stream {
    target: odfs_proto::TargetId,
    sock: TcpStream,
    /// Requests not sent yet, and those of the send on the ring.
    pending: Vec<u8>,
    sending: Vec<u8>,
    /// Bytes received and not yet parsed into replies (`filled` of them); whether a receive
    /// is on the ring.
    inbuf: Vec<u8>,
    filled: usize,
    receiving: bool,
    /// Calls awaiting their reply: the entry each answers, and the bytes it asked for.
    calls: std::collections::HashMap<u64, (usize, usize)>,
    dead: bool,
}

/// A reply frame's length prefix and fixed part.
const REPLY_HEAD: usize = 4 + odfs_proto::codec::FRAME_FIXED;
/// The room a stream's receive is given at least.
const RECEIVE_ROOM: usize = 256 << 10;

impl Streams {
    /// Asks for entry `i`'s READ of `len` bytes at `offset` of `file`: a `ReadChunk` request
    /// queued on the stream to the stored holding them (connected on first use), sent at the
    /// round's end. `None` where the READ spans chunks or no stream could be had.
    fn ask(
        &mut self,
        rt: &tokio::runtime::Handle,
        client: &odfs_client::Client,
        file: &odfs_client::FileHandle,
        offset: u64,
        len: usize,
        i: usize,
    ) -> Option<()> {
        use odfs_proto::storage::ReadChunk;
        let mut segs = file.layout().segments(offset, len as u64);
        let seg = segs.next()?;
        if segs.next().is_some() {
            return None;
        }
        let si = match self.by_target.get(&seg.target) {
            Some(&si) => si,
            None => {
                let (sock, header) = rt.block_on(client.chunk_stream(seg.target)).ok()?;
                self.header.get_or_insert(header);
                self.all.push(Stream {
                    target: seg.target,
                    sock,
                    pending: Vec::new(),
                    sending: Vec::new(),
                    inbuf: Vec::new(),
                    filled: 0,
                    receiving: false,
                    calls: Default::default(),
                    dead: false,
                });
                self.by_target.insert(seg.target, self.all.len() - 1);
                self.all.len() - 1
            }
        };
        self.next_call += 1;
        let req = ReadChunk { target: seg.target, ino: file.ino(), offset: seg.local_offset, len: len as u32 };
        let frame = odfs_proto::codec::encode_request(self.next_call, self.header.as_ref()?, &req).ok()?;
        let s = &mut self.all[si];
        s.pending.extend_from_slice(&frame.head);
        s.calls.insert(self.next_call, (i, len));
        Some(())
    }

    /// The sends of requests asked since the last round, and a receive on every stream that
    /// awaits replies and has none on the ring.
    fn flush(&mut self) -> Vec<squeue::Entry128> {
        let mut sqes = Vec::new();
        for (si, s) in self.all.iter_mut().enumerate().filter(|(_, s)| !s.dead) {
            let fd = types::Fd(s.sock.as_raw_fd());
            if s.sending.is_empty() && !s.pending.is_empty() {
                std::mem::swap(&mut s.sending, &mut s.pending);
                let send = opcode::Send::new(fd, s.sending.as_ptr(), s.sending.len() as u32)
                    .flags(libc::MSG_WAITALL)
                    .build()
                    .user_data(tag(si, STREAM_SENT));
                sqes.push(send.into());
            }
            if !s.receiving && !s.calls.is_empty() {
                if s.inbuf.len() - s.filled < RECEIVE_ROOM {
                    s.inbuf.resize(s.filled + RECEIVE_ROOM, 0);
                }
                let room = &mut s.inbuf[s.filled..];
                let recv = opcode::Recv::new(fd, room.as_mut_ptr(), room.len() as u32)
                    .build()
                    .user_data(tag(si, STREAM_RECEIVED));
                sqes.push(recv.into());
                s.receiving = true;
            }
        }
        sqes
    }

    /// Stream `si`'s send completed (`res` bytes, or -errno).
    fn sent(&mut self, si: usize, res: i32, tree: &Tree, qid: u16, ents: &mut [Entry]) -> Vec<squeue::Entry128> {
        let s = &mut self.all[si];
        if s.dead {
            return Vec::new();
        }
        if res < 0 || res as usize != s.sending.len() {
            return self.fail(si, tree, qid, ents);
        }
        s.sending.clear();
        Vec::new()
    }

    /// Stream `si`'s receive completed (`res` bytes, or -errno): every whole reply in what it
    /// holds answers its entry's READ.
    fn received(&mut self, si: usize, res: i32, tree: &Tree, qid: u16, ents: &mut [Entry]) -> Vec<squeue::Entry128> {
        use odfs_proto::codec::{FrameHead, KIND_REPLY_OK, MAX_FRAME};
        let s = &mut self.all[si];
        s.receiving = false;
        if s.dead {
            return Vec::new();
        }
        if res <= 0 {
            return self.fail(si, tree, qid, ents);
        }
        s.filled += res as usize;
        let (mut commits, mut at, mut lost) = (Vec::new(), 0, false);
        while s.filled - at >= REPLY_HEAD {
            let len = u32_at(&s.inbuf, at) as usize;
            let head = (len <= MAX_FRAME).then(|| FrameHead::parse(&s.inbuf[at + 4..at + REPLY_HEAD], len).ok());
            let Some(h) = head.flatten() else {
                lost = true;
                break;
            };
            if s.filled - at < 4 + len {
                // The rest of this reply is still to come.
                break;
            }
            let Some((i, want)) = s.calls.remove(&h.call_id) else {
                lost = true;
                break;
            };
            let got = h.payload as usize;
            let bytes_at = at + 4 + len - got;
            let e = &mut ents[i];
            commits.extend(if h.kind != KIND_REPLY_OK || got > want {
                commit(tree, qid, i, e, libc::EIO, 0)
            } else {
                let into = e.payload.as_mut_slice();
                into[..got].copy_from_slice(&s.inbuf[bytes_at..bytes_at + got]);
                // Fewer bytes than asked: the chunk file ends there, a hole inside the file.
                into[got..want].fill(0);
                self.read += 1;
                commit(tree, qid, i, e, 0, want)
            });
            at += 4 + len;
        }
        if lost {
            // A reply that does not parse, or answers no call of this stream's.
            commits.extend(self.fail(si, tree, qid, ents));
            return commits;
        }
        s.inbuf.copy_within(at..s.filled, 0);
        s.filled -= at;
        commits
    }

    /// Stream `si` failed: every READ it was to answer gets EIO, and it is shut down (its
    /// buffers kept until the queue ends, as the ring may still use them).
    fn fail(&mut self, si: usize, tree: &Tree, qid: u16, ents: &mut [Entry]) -> Vec<squeue::Entry128> {
        let s = &mut self.all[si];
        s.dead = true;
        // SAFETY: shutdown of the stream's own open socket; its pending operations then end.
        unsafe { libc::shutdown(s.sock.as_raw_fd(), libc::SHUT_RDWR) };
        if self.by_target.get(&s.target) == Some(&si) {
            self.by_target.remove(&s.target);
        }
        s.calls.drain().flat_map(|(_, (i, _))| commit(tree, qid, i, &mut ents[i], libc::EIO, 0)).collect()
    }
}

/// Reads `len` bytes at `offset` of `file` through odfs's client as a task of `rt`, copies them
/// into entry `i`'s payload buffer `into`, and wakes the queue's thread to answer (`done`).
fn read_on_runtime(
    rt: &tokio::runtime::Handle,
    file: Arc<odfs_client::FileHandle>,
    offset: u64,
    len: usize,
    i: usize,
    into: PayloadPtr,
    done: Arc<Done>,
) {
    rt.spawn(async move {
        let into = into;
        let res = match file.read(offset, len as u32).await {
            Ok(got) => {
                let n = got.len().min(len);
                // SAFETY: the entry's payload buffer holds MAX_IO >= len bytes and is this
                // task's until it reports below.
                unsafe { std::ptr::copy_nonoverlapping(got.as_ptr(), into.0, n) };
                n as i32
            }
            Err(_) => -libc::EIO,
        };
        done.finished.lock().expect("done lock").push((i, res));
        let one = 1u64.to_ne_bytes();
        // SAFETY: an 8-byte write of the eventfd `done` owns.
        unsafe { libc::write(done.efd, one.as_ptr().cast(), 8) };
    });
}

/// Entry `i`'s reply (`errno`, or `len` payload bytes) committed, and the next request asked.
fn commit(tree: &Tree, qid: u16, i: usize, e: &mut Entry, errno: i32, len: usize) -> Vec<squeue::Entry128> {
    let header = e.header.as_mut_slice();
    let unique = u64_at(header, 8);
    let commit_id = u64_at(header, ENT_COMMIT_ID);
    let len = if errno != 0 { 0 } else { len };
    header[..abi::OUT_HEADER].copy_from_slice(&abi::out_header(unique, len, errno));
    put32(header, ENT_PAYLOAD_SZ, len as u32);
    vec![ring_cmd(tree.dev, CMD_COMMIT_AND_FETCH, commit_id, qid, None).user_data(tag(i, FETCHED))]
}
