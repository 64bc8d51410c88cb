//! TCP bulk streams, authenticated with the job credential.
//!
//! Chunk data may travel over plain TCP because on these machines it costs a fraction of QUIC's
//! CPU per byte (see BENCHMARKS.md). The stream is not encrypted; both ends prove they hold the
//! job's bulk key with a mutual HMAC challenge before any request is served:
//!
//! ```text
//! client -> server: "ODFSBULK" | u32 version | nonce_c[32]
//! server -> client: nonce_s[32] | HMAC(k, "server" | nonce_c | nonce_s)
//! client -> server: HMAC(k, "client" | nonce_s | nonce_c)
//! server -> client: 0x01 (accepted)
//! ```

use crate::{Conn, JobCredential, Router, RpcError, Shutdown};
use hmac::{Hmac, Mac};
use odfs_proto::PROTOCOL_VERSION;
use rand::RngCore;
use sha2::Sha256;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

const MAGIC: &[u8; 8] = b"ODFSBULK";
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

fn mac(key: &[u8; 32], role: &[u8], a: &[u8; 32], b: &[u8; 32]) -> [u8; 32] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    m.update(role);
    m.update(a);
    m.update(b);
    m.finalize().into_bytes().into()
}

fn verify(key: &[u8; 32], role: &[u8], a: &[u8; 32], b: &[u8; 32], tag: &[u8; 32]) -> bool {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    m.update(role);
    m.update(a);
    m.update(b);
    m.verify_slice(tag).is_ok()
}

fn nonce() -> [u8; 32] {
    let mut n = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// Why a client's handshake failed: the server proved another credential, or anything else.
enum HandshakeError {
    Credential(String),
    Other(String),
}

impl From<String> for HandshakeError {
    fn from(s: String) -> HandshakeError {
        HandshakeError::Other(s)
    }
}

async fn client_handshake(s: &mut TcpStream, key: &[u8; 32]) -> Result<(), HandshakeError> {
    let nc = nonce();
    let mut hello = Vec::with_capacity(44);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    hello.extend_from_slice(&nc);
    s.write_all(&hello).await.map_err(|e| e.to_string())?;
    let mut reply = [0u8; 64];
    s.read_exact(&mut reply)
        .await
        .map_err(|_| "peer closed during the handshake (wrong job credential?)".to_string())?;
    let ns: [u8; 32] = reply[..32].try_into().expect("32 bytes");
    let tag: [u8; 32] = reply[32..].try_into().expect("32 bytes");
    if !verify(key, b"server", &nc, &ns, &tag) {
        return Err(HandshakeError::Credential("server does not hold this job's credential".into()));
    }
    s.write_all(&mac(key, b"client", &ns, &nc)).await.map_err(|e| e.to_string())?;
    let mut ok = [0u8; 1];
    s.read_exact(&mut ok).await.map_err(|_| "server refused this job's credential".to_string())?;
    if ok[0] != 1 {
        return Err("server refused the handshake".to_string().into());
    }
    Ok(())
}

async fn server_handshake(s: &mut TcpStream, key: &[u8; 32]) -> Result<(), String> {
    let mut hello = [0u8; 44];
    s.read_exact(&mut hello).await.map_err(|e| format!("short hello: {e}"))?;
    if &hello[..8] != MAGIC {
        return Err("not an odfs bulk client".into());
    }
    let version = u32::from_le_bytes(hello[8..12].try_into().expect("4 bytes"));
    if version != PROTOCOL_VERSION {
        return Err(format!("protocol version {version}, expected {PROTOCOL_VERSION}"));
    }
    let nc: [u8; 32] = hello[12..].try_into().expect("32 bytes");
    let ns = nonce();
    let mut reply = Vec::with_capacity(64);
    reply.extend_from_slice(&ns);
    reply.extend_from_slice(&mac(key, b"server", &nc, &ns));
    s.write_all(&reply).await.map_err(|e| e.to_string())?;
    let mut tag = [0u8; 32];
    s.read_exact(&mut tag).await.map_err(|e| format!("short proof: {e}"))?;
    if !verify(key, b"client", &ns, &nc, &tag) {
        return Err("client does not hold this job's credential".into());
    }
    s.write_all(&[1]).await.map_err(|e| e.to_string())?;
    Ok(())
}

/// Connects to a bulk listener and proves the job credential.
pub async fn connect(cred: &JobCredential, addr: SocketAddr) -> Result<Conn, RpcError> {
    let (r, w) = connect_stream(cred, addr).await?.into_split();
    Ok(Conn::new(r, w, format!("tcp {addr}")))
}

/// Connects to a bulk listener and proves the job credential: the stream, ready for frames.
pub async fn connect_stream(cred: &JobCredential, addr: SocketAddr) -> Result<TcpStream, RpcError> {
    let mut s = tokio::time::timeout(HANDSHAKE_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| RpcError::Connect { addr, reason: "connect timed out".into() })?
        .map_err(|e| RpcError::Connect { addr, reason: e.to_string() })?;
    s.set_nodelay(true)?;
    tokio::time::timeout(HANDSHAKE_TIMEOUT, client_handshake(&mut s, cred.bulk_key()))
        .await
        .map_err(|_| RpcError::Connect { addr, reason: "handshake timed out".into() })?
        .map_err(|reason| match reason {
            // The peer answered, with another job's proof: no retry makes it this job's.
            HandshakeError::Credential(why) => RpcError::Credential(format!("{addr}: {why}")),
            HandshakeError::Other(reason) => RpcError::Connect { addr, reason },
        })?;
    Ok(s)
}

/// Binds a bulk listener; a taken port is a clear error.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, RpcError> {
    TcpListener::bind(addr).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            RpcError::Connect { addr, reason: format!("TCP port {} is already in use", addr.port()) }
        } else {
            RpcError::Connect { addr, reason: format!("cannot bind: {e}") }
        }
    })
}

/// Serves authenticated bulk streams until shutdown.
pub async fn serve(listener: TcpListener, cred: JobCredential, router: Arc<Router>, mut shutdown: Shutdown) {
    let key = *cred.bulk_key();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => break,
        };
        let (mut s, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let router = router.clone();
        tokio::spawn(async move {
            let _ = s.set_nodelay(true);
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, server_handshake(&mut s, &key)).await {
                Ok(Ok(())) => {
                    debug!(%peer, "bulk stream authenticated");
                    let (r, w) = s.into_split();
                    crate::router::serve_stream(router, r, w).await;
                }
                Ok(Err(why)) => warn!(%peer, reason = %why, "refused bulk stream"),
                Err(_) => warn!(%peer, "refused bulk stream: handshake timed out"),
            }
        });
    }
}
