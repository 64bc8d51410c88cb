//! Real QUIC and TCP endpoints on loopback: calls, multiplexing, and refusals.

use odfs_proto::mgmt::TargetSpace;
use odfs_proto::storage::StatTarget;
use odfs_proto::{ErrorCode, RemoteError, RequestHeader};
use odfs_rpc::quic::QuicEndpoint;
use odfs_rpc::{JobCredential, Pool, PoolConfig, Router, SiteKey, Transport};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn router() -> Arc<Router> {
    let mut r = Router::new();
    r.add::<StatTarget, _, _>(|h: RequestHeader, req: StatTarget| async move {
        if req.target == 0 {
            return Err(RemoteError::new(ErrorCode::NotFound, "no target 0"));
        }
        Ok(TargetSpace { capacity: req.target as u64, free: h.uid as u64, ..Default::default() })
    });
    Arc::new(r)
}

struct Server {
    quic: std::net::SocketAddr,
    tcp: std::net::SocketAddr,
    _stop: tokio::sync::watch::Sender<bool>,
}

async fn start(cred: &JobCredential) -> Server {
    start_with(cred, router()).await
}

/// A server of `r` on both transports.
async fn start_with(cred: &JobCredential, r: Arc<Router>) -> Server {
    let (stop, rx) = tokio::sync::watch::channel(false);
    let ep = QuicEndpoint::server(cred, "127.0.0.1:0".parse().unwrap()).unwrap();
    let quic = ep.local_addr().unwrap();
    tokio::spawn({
        let r = r.clone();
        let rx = rx.clone();
        async move { ep.serve(r, rx).await }
    });
    let l = odfs_rpc::tcp::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let tcp = l.local_addr().unwrap();
    tokio::spawn(odfs_rpc::tcp::serve(l, cred.clone(), r, rx));
    Server { quic, tcp, _stop: stop }
}

fn quick() -> PoolConfig {
    PoolConfig { call_timeout: Duration::from_secs(5), retry_deadline: Duration::from_millis(300), conns_per_peer: 1 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_succeed_and_multiplex_on_both_transports() {
    let site = SiteKey::from_bytes([1; 32]);
    let cred = JobCredential::derive(&site, "job-1").unwrap();
    let srv = start(&cred).await;
    let pool = Arc::new(Pool::new(cred, quick()).unwrap());
    for (addr, t) in [(srv.quic, Transport::Quic), (srv.tcp, Transport::Tcp)] {
        let mut tasks = Vec::new();
        for i in 1..=500u32 {
            let pool = pool.clone();
            tasks.push(tokio::spawn(async move {
                let h = RequestHeader { uid: i, ..Default::default() };
                pool.call(addr, t, &h, &StatTarget { target: i }).await
            }));
        }
        for (i, t) in tasks.into_iter().enumerate() {
            let got = t.await.unwrap().unwrap();
            assert_eq!(got.capacity, i as u64 + 1);
            assert_eq!(got.free, i as u64 + 1);
        }
        let h = RequestHeader::default();
        let e = pool.call(addr, t, &h, &StatTarget { target: 0 }).await.unwrap_err();
        assert_eq!(e.to_remote().code, ErrorCode::NotFound);
    }
}

/// A call polled once (it starts connecting) and then left unpolled, as one of several calls
/// in a stream whose owner awaits another call, must not keep other calls from the peer.
///
/// One thread: nothing else runs while the test polls, so the first poll surely finds the
/// connect unfinished (with worker threads a preempted test thread could find the whole call
/// done), and a connect that needs its caller polled would hold the second call for ever.
#[tokio::test(flavor = "current_thread")]
async fn a_call_left_unpolled_while_connecting_holds_up_no_other_call() {
    let site = SiteKey::from_bytes([1; 32]);
    let cred = JobCredential::derive(&site, "job-1").unwrap();
    let srv = start(&cred).await;
    for (addr, t) in [(srv.quic, Transport::Quic), (srv.tcp, Transport::Tcp)] {
        let pool = Pool::new(cred.clone(), quick()).unwrap();
        let h = RequestHeader::default();
        let (first, second) = (StatTarget { target: 7 }, StatTarget { target: 9 });
        let mut parked = std::pin::pin!(pool.call(addr, t, &h, &first));
        assert!(futures::poll!(parked.as_mut()).is_pending(), "{t:?}: the first call is connecting");
        let other = tokio::time::timeout(Duration::from_secs(20), pool.call(addr, t, &h, &second))
            .await
            .unwrap_or_else(|_| panic!("{t:?}: the second call waited for the unpolled first one"));
        assert_eq!(other.unwrap().capacity, 9);
        assert_eq!(parked.await.unwrap().capacity, 7);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_jobs_credential_is_refused() {
    let site = SiteKey::from_bytes([1; 32]);
    let cred = JobCredential::derive(&site, "job-1").unwrap();
    let srv = start(&cred).await;
    let intruders = [
        JobCredential::derive(&site, "job-2").unwrap(),
        JobCredential::derive(&SiteKey::from_bytes([2; 32]), "job-1").unwrap(),
    ];
    for other in intruders {
        let pool = Pool::new(other, quick()).unwrap();
        let h = RequestHeader::default();
        let e = pool.call(srv.quic, Transport::Quic, &h, &StatTarget { target: 3 }).await.unwrap_err();
        // A refusal of the credential, which no caller retries.
        assert!(matches!(e, odfs_rpc::RpcError::Credential(_)) && !e.retryable(), "quic: {e}");
        let e = pool.call(srv.tcp, Transport::Tcp, &h, &StatTarget { target: 3 }).await.unwrap_err();
        assert!(matches!(e, odfs_rpc::RpcError::Credential(_)) && !e.retryable(), "tcp: {e}");
    }
    // A raw TCP peer with no credential gets nothing served.
    let mut s = tokio::net::TcpStream::connect(srv.tcp).await.unwrap();
    s.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
    let mut buf = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await.unwrap().unwrap_or(0);
    assert_eq!(n, 0, "server answered an unauthenticated peer: {buf:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_close_the_stream_but_not_the_server() {
    let site = SiteKey::from_bytes([1; 32]);
    let cred = JobCredential::derive(&site, "job-1").unwrap();
    let srv = start(&cred).await;
    let pool = Pool::new(cred.clone(), quick()).unwrap();
    let conn = pool.conn(srv.tcp, Transport::Tcp).await.unwrap();
    // Garbage from a peer: the server drops that stream only.
    let mut raw = tokio::net::TcpStream::connect(srv.tcp).await.unwrap();
    raw.write_all(&[0xff; 64]).await.unwrap();
    drop(raw);
    let h = RequestHeader { uid: 5, ..Default::default() };
    let got = conn.call(&h, &StatTarget { target: 9 }, Duration::from_secs(5)).await.unwrap();
    assert_eq!(got.capacity, 9);
    // Unknown method and undecodable body get error replies, not a crash.
    let got = pool
        .call(
            srv.quic,
            Transport::Quic,
            &h,
            &odfs_proto::storage::SyncChunk { target: 1, ino: odfs_proto::InodeId::ROOT },
        )
        .await
        .unwrap_err();
    assert_eq!(got.to_remote().code, ErrorCode::BadMethod);
}

/// A thread with a lane of its own calls over a connection of its own, driven by its own
/// runtime: its calls complete while the runtime holding the shared connections stands still.
/// A thread without a lane reuses the shared connection and cannot complete there.
#[test]
fn a_lane_calls_over_its_own_connection() {
    let site = SiteKey::from_bytes([1; 32]);
    let cred = JobCredential::derive(&site, "job-1").unwrap();
    let server_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let srv = server_rt.block_on(start(&cred));
    // The shared runtime: a current-thread one, driven only inside its block_on.
    let shared = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let cfg = PoolConfig { call_timeout: Duration::from_secs(1), ..quick() };
    let pool = Arc::new(shared.block_on(async { Pool::new(cred, cfg) }).unwrap());
    let addr = srv.tcp;
    let call = move |pool: Arc<Pool>, uid: u32| async move {
        let h = RequestHeader { uid, ..Default::default() };
        pool.call(addr, Transport::Tcp, &h, &StatTarget { target: 7 }).await
    };
    assert_eq!(shared.block_on(call(pool.clone(), 1)).unwrap().free, 1);

    let on_thread = |lane: bool, calls: u32| {
        let pool = pool.clone();
        std::thread::spawn(move || {
            if lane {
                assert!(odfs_rpc::own_lane() > 0);
            }
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            (0..calls).map(|i| rt.block_on(call(pool.clone(), 100 + i)).map(|r| r.free)).collect::<Vec<_>>()
        })
        .join()
        .unwrap()
    };
    let got: Vec<u64> = on_thread(true, 50).into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(got, (100u64..150).collect::<Vec<_>>());
    let stuck = on_thread(false, 1);
    assert!(
        matches!(stuck[0], Err(odfs_rpc::RpcError::Timeout { .. })),
        "a call without a lane went over the shared connection and should have waited for its runtime: {:?}",
        stuck[0]
    );
    drop(srv);
}

/// A request whose handler waits does not hold back the stream it came on: the server reads
/// and answers the next request meanwhile (here the one that ends the wait), on either
/// transport. Answered-at-once and waiting handlers share the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_handler_does_not_hold_back_its_stream() {
    let site = SiteKey::from_bytes([1; 32]);
    let cred = JobCredential::derive(&site, "job-1").unwrap();
    let gate = Arc::new(tokio::sync::Notify::new());
    let mut r = Router::new();
    let g = gate.clone();
    r.add::<StatTarget, _, _>(move |_h: RequestHeader, req: StatTarget| {
        let g = g.clone();
        async move {
            match req.target {
                1 => g.notified().await,
                2 => g.notify_one(),
                _ => {}
            }
            Ok(TargetSpace { capacity: req.target as u64, ..Default::default() })
        }
    });
    let srv = start_with(&cred, Arc::new(r)).await;
    // One connection per peer: every call below shares one stream.
    let pool = Arc::new(Pool::new(cred, quick()).unwrap());
    for (addr, t) in [(srv.quic, Transport::Quic), (srv.tcp, Transport::Tcp)] {
        let call = |target: u32| {
            let pool = pool.clone();
            async move { pool.call(addr, t, &RequestHeader::default(), &StatTarget { target }).await }
        };
        let waiting = tokio::spawn(call(1));
        // The waiting request is in its handler before the others are sent.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished(), "{t:?}: the waiting handler answered before it was released");
        assert_eq!(call(3).await.unwrap().capacity, 3, "{t:?}: a request behind a waiting one");
        assert_eq!(call(2).await.unwrap().capacity, 2, "{t:?}: the request that ends the wait");
        let done = tokio::time::timeout(Duration::from_secs(5), waiting).await;
        assert_eq!(done.expect("the waiting call never finished").unwrap().unwrap().capacity, 1, "{t:?}");
    }
}

/// A reply's file spans arrive as its payload on either transport (sent by sendfile on TCP),
/// large ones too (the socket fills and drains meanwhile); a span longer than what is left of
/// its file (the file shrank) arrives padded with zeros, and the stream stays framed: the
/// calls after it on the same stream are answered right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_spans_arrive_as_the_payload_on_both_transports() {
    use odfs_proto::codec::FileSpan;
    use odfs_proto::storage::{ChunkRange, ChunksData, ReadChunks};
    let site = SiteKey::from_bytes([1; 32]);
    let cred = JobCredential::derive(&site, "job-1").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let contents: Vec<Vec<u8>> = [3usize, 70_000, 6 << 20]
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| (j * 7 + i) as u8).collect())
        .collect();
    for (i, c) in contents.iter().enumerate() {
        std::fs::write(dir.path().join(i.to_string()), c).unwrap();
    }
    let root = dir.path().to_path_buf();
    let mut r = Router::new();
    r.add::<ReadChunks, _, _>(move |_h: RequestHeader, req: ReadChunks| {
        let root = root.clone();
        async move {
            let spans: Vec<FileSpan> = req
                .items
                .iter()
                .map(|c| FileSpan {
                    file: Arc::new(std::fs::File::open(root.join(c.ino.0.to_string())).unwrap()),
                    offset: c.offset,
                    len: c.len,
                })
                .collect();
            Ok(ChunksData { lens: req.items.iter().map(|c| Some(c.len)).collect(), spans, ..Default::default() })
        }
    });
    let srv = start_with(&cred, Arc::new(r)).await;
    let pool = Arc::new(Pool::new(cred, quick()).unwrap());
    let range = |ino: u64, offset: u64, len: u32| ChunkRange { ino: odfs_proto::InodeId(ino), offset, len };
    for (addr, t) in [(srv.quic, Transport::Quic), (srv.tcp, Transport::Tcp)] {
        let h = RequestHeader::default();
        for round in 0..3 {
            let items = vec![range(0, 0, 3), range(1, 100, 60_000), range(2, 0, 6 << 20), range(1, 69_990, 100)];
            let got = pool.call(addr, t, &h, &ReadChunks { target: 1, items }).await.unwrap();
            let mut want = contents[0].clone();
            want.extend_from_slice(&contents[1][100..60_100]);
            want.extend_from_slice(&contents[2]);
            want.extend_from_slice(&contents[1][69_990..]);
            want.extend_from_slice(&[0u8; 90]);
            assert_eq!(got.lens, vec![Some(3), Some(60_000), Some(6 << 20), Some(100)], "{t:?} round {round}");
            assert!(got.data == want, "{t:?} round {round}: the spans' bytes, zeros past the shrunk file's end");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_payloads_arrive_page_aligned_whole_and_intact_on_both_transports() {
    use odfs_proto::storage::{WriteChunk, Written};
    let site = SiteKey::from_bytes([1; 32]);
    let cred = JobCredential::derive(&site, "job-1").unwrap();
    let mut r = Router::new();
    // Answers with the payload's CRC and, as its length, where in a page its first byte sits
    // (u32::MAX if it arrived in more than one buffer).
    r.add::<WriteChunk, _, _>(|_h: RequestHeader, q: WriteChunk| async move {
        let data = q.data.contiguous();
        let misalign = data.as_ptr() as usize % odfs_rpc::PAYLOAD_ALIGN;
        let len = if q.data.pieces().len() > 1 { u32::MAX } else { misalign as u32 };
        Ok(Written { len, crc32c: Some(crc32c::crc32c(&data)) })
    });
    let srv = start_with(&cred, Arc::new(r)).await;
    let pool = Arc::new(Pool::new(cred, quick()).unwrap());
    for (addr, t) in [(srv.quic, Transport::Quic), (srv.tcp, Transport::Tcp)] {
        // Requests of several sizes back to back on one stream, so payloads start mid-buffer;
        // every other one sent as several pieces of uneven sizes (a vectored write).
        let mut calls = Vec::new();
        for (i, len) in [4096usize, 1 << 20, 100, 70_001, 3 << 20, 12_288, 300_000, 5].into_iter().enumerate() {
            let data: Vec<u8> = (0..len).map(|j| (j * 31 + i) as u8).collect();
            let crc = crc32c::crc32c(&data);
            let mut payload = odfs_proto::codec::Payload::default();
            let whole = bytes::Bytes::from(data);
            let cuts: Vec<usize> = if i % 2 == 1 { vec![0, len / 7, len / 7 + 1, len / 2, len] } else { vec![0, len] };
            for w in cuts.windows(2) {
                payload.push(whole.slice(w[0]..w[1]));
            }
            let pool = pool.clone();
            calls.push(tokio::spawn(async move {
                let q = WriteChunk {
                    target: 1,
                    ino: odfs_proto::InodeId(9),
                    offset: 0,
                    data: payload,
                    sync: false,
                    crc: true,
                };
                let got = pool.call(addr, t, &RequestHeader::default(), &q).await.unwrap();
                (len, crc, got)
            }));
        }
        for c in calls {
            let (len, crc, got) = c.await.unwrap();
            assert_eq!(got.crc32c, Some(crc), "{t:?}: {len} bytes arrived intact");
            if len >= odfs_rpc::PAYLOAD_ALIGN {
                assert_eq!(got.len, 0, "{t:?}: a {len}-byte payload starts on a page boundary");
            }
        }
    }
}

/// Everything `pipe` holds, spliced out into a file and read back.
fn drain_pipe(pipe: &mut odfs_rpc::splice::Pipe) -> Vec<u8> {
    use std::io::{Read, Seek};
    use std::os::fd::AsRawFd;
    let mut f = tempfile::tempfile().unwrap();
    if pipe.held() > 0 {
        pipe.splice_all_into(f.as_raw_fd()).unwrap();
    }
    f.rewind().unwrap();
    let mut out = Vec::new();
    f.read_to_end(&mut out).unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spliced_reply_puts_exactly_its_payload_in_the_pipe_from_a_buffer_or_a_file() {
    use odfs_proto::codec::FileSpan;
    use odfs_proto::storage::{ChunkData, ReadChunk};
    use odfs_rpc::splice::{Pipe, SpliceStream};
    let site = SiteKey::from_bytes([1; 32]);
    let cred = JobCredential::derive(&site, "job-1").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let content: Vec<u8> = (0..(3 << 20) + 123).map(|j: usize| (j * 13 + j / 4099) as u8).collect();
    let path = dir.path().join("chunk");
    std::fs::write(&path, &content).unwrap();
    let mut r = Router::new();
    // Target 1 answers from a buffer, target 2 from the file (sendfile), target 0 refuses.
    r.add::<ReadChunk, _, _>(move |_h: RequestHeader, q: ReadChunk| {
        let path = path.clone();
        async move {
            let total = (3 << 20) + 123;
            let at = (q.offset as usize).min(total);
            let end = (at + q.len as usize).min(total);
            match q.target {
                0 => Err(RemoteError::new(ErrorCode::NoSpace, "target 0 is full")),
                _ if at == end => Ok(ChunkData::default()),
                1 => {
                    let all = std::fs::read(&path).unwrap();
                    Ok(ChunkData { data: all[at..end].to_vec(), ..Default::default() })
                }
                _ => {
                    let file = Arc::new(std::fs::File::open(&path).unwrap());
                    let span = FileSpan { file, offset: q.offset, len: (end - at) as u32 };
                    Ok(ChunkData { spans: vec![span], ..Default::default() })
                }
            }
        }
    });
    let srv = start_with(&cred, Arc::new(r)).await;
    let mut s = SpliceStream::connect(&cred, srv.tcp).await.unwrap();
    let h = RequestHeader::default();
    for target in [1, 2] {
        // Pipes of 1 MiB: what any process may make (`fs.pipe-max-size` by default).
        for (offset, len) in [(0u64, 512u32 << 10), (4097, 300_001), ((3 << 20) - 10, 512 << 10), (5 << 20, 4096)] {
            let mut pipe = Pipe::new(1 << 20).unwrap();
            pipe.write_all(b"head").unwrap();
            let call = s.send(&h, &ReadChunk { target, ino: odfs_proto::InodeId(7), offset, len }).await.unwrap();
            let n = s.receive_into::<ReadChunk>(call, &mut pipe).await.unwrap();
            let at = (offset as usize).min(content.len());
            let want = &content[at..(at + len as usize).min(content.len())];
            assert_eq!(n, want.len(), "target {target}, {len} bytes at {offset}");
            let got = drain_pipe(&mut pipe);
            assert!(got[..4] == *b"head" && got[4..] == *want, "target {target}, {len} bytes at {offset}: the bytes");
        }
    }
    // A refusal comes back as itself, and the stream goes on.
    let mut pipe = Pipe::new(1 << 20).unwrap();
    let call = s.send(&h, &ReadChunk { target: 0, ino: odfs_proto::InodeId(7), offset: 0, len: 10 }).await.unwrap();
    let e = s.receive_into::<ReadChunk>(call, &mut pipe).await.unwrap_err();
    assert_eq!(e.to_remote().code, ErrorCode::NoSpace, "{e}");
    assert_eq!(pipe.held(), 0, "a refusal puts nothing in the pipe");
    let call = s.send(&h, &ReadChunk { target: 2, ino: odfs_proto::InodeId(7), offset: 10, len: 20 }).await.unwrap();
    assert_eq!(s.receive_into::<ReadChunk>(call, &mut pipe).await.unwrap(), 20);
    assert_eq!(drain_pipe(&mut pipe), content[10..30]);
    // A reply larger than the pipe can hold is refused before any of it is taken.
    let mut small = Pipe::new(64 << 10).unwrap();
    let call =
        s.send(&h, &ReadChunk { target: 2, ino: odfs_proto::InodeId(7), offset: 0, len: 512 << 10 }).await.unwrap();
    assert!(s.receive_into::<ReadChunk>(call, &mut small).await.is_err(), "a 512 KiB reply into a 64 KiB pipe");
    assert_eq!(small.held(), 0);
    // Another job's credential gets no stream.
    let other = JobCredential::derive(&SiteKey::from_bytes([2; 32]), "job-1").unwrap();
    assert!(SpliceStream::connect(&other, srv.tcp).await.is_err(), "another job's credential is refused");
}
