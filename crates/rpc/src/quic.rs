//! QUIC endpoints with per-job mutual TLS.
//!
//! Both sides present the job's certificate and accept a peer only if it presents exactly the
//! same certificate and proves possession of its key (TLS 1.3 CertificateVerify). A peer with
//! another job's credential, or none, fails the handshake and never reaches a handler.

use crate::{Conn, JobCredential, Router, RpcError, Shutdown};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, info, warn};

/// ALPN of this protocol version.
pub const ALPN: &[u8] = b"odfs/1";
/// Server name both sides use (the certificate names it).
pub const SERVER_NAME: &str = "odfs";

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Accepts exactly one certificate: the job's.
#[derive(Debug)]
struct JobCertVerifier {
    expected: CertificateDer<'static>,
    provider: Arc<CryptoProvider>,
}

impl JobCertVerifier {
    fn check(&self, presented: &CertificateDer<'_>) -> Result<(), rustls::Error> {
        if presented.as_ref() == self.expected.as_ref() {
            Ok(())
        } else {
            Err(rustls::Error::General("peer does not hold this job's credential".into()))
        }
    }
}

/// The signature checks both verifier traits share: TLS 1.3 only, Ed25519 only.
macro_rules! signature_checks {
    () => {
        fn verify_tls12_signature(
            &self,
            _message: &[u8],
            _cert: &CertificateDer<'_>,
            _dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Err(rustls::Error::General("TLS 1.2 is not accepted".into()))
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            vec![SignatureScheme::ED25519]
        }
    };
}

impl ServerCertVerifier for JobCertVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity).map(|_| ServerCertVerified::assertion())
    }

    signature_checks!();
}

impl ClientCertVerifier for JobCertVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.check(end_entity).map(|_| ClientCertVerified::assertion())
    }

    signature_checks!();
}

fn transport_config() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_bidi_streams(1024u32.into());
    t.max_concurrent_uni_streams(0u32.into());
    t.stream_receive_window((16u32 << 20).into());
    t.receive_window((64u32 << 20).into());
    t.send_window(64 << 20);
    t.keep_alive_interval(Some(Duration::from_secs(2)));
    // Every peer is in the same cluster: a 10 ms first guess of the round trip (quinn's default,
    // 333 ms, is for the internet) resends a lost first packet — one sent while a daemon was
    // still binding its port, during a job's start — after tens of milliseconds, not a second.
    t.initial_rtt(Duration::from_millis(10));
    t.max_idle_timeout(Some(Duration::from_secs(10).try_into().expect("10 s is a valid idle timeout")));
    t
}

fn cred_err(e: impl std::fmt::Display) -> RpcError {
    RpcError::Credential(e.to_string())
}

fn endpoint_config(cred: &JobCredential) -> quinn::EndpointConfig {
    // A reset key shared by the job lets a restarted daemon on the same port reset connections
    // its previous incarnation held, so clients notice at once instead of after the idle timeout.
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, cred.reset_key());
    quinn::EndpointConfig::new(Arc::new(key))
}

fn server_config(cred: &JobCredential) -> Result<quinn::ServerConfig, RpcError> {
    let provider = provider();
    let verifier = Arc::new(JobCertVerifier { expected: cred.cert().clone(), provider: provider.clone() });
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(cred_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![cred.cert().clone()], cred.private_key())
        .map_err(cred_err)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let qsc = QuicServerConfig::try_from(tls).map_err(cred_err)?;
    let mut sc = quinn::ServerConfig::with_crypto(Arc::new(qsc));
    sc.transport_config(Arc::new(transport_config()));
    Ok(sc)
}

fn client_config(cred: &JobCredential) -> Result<quinn::ClientConfig, RpcError> {
    let provider = provider();
    let verifier = Arc::new(JobCertVerifier { expected: cred.cert().clone(), provider: provider.clone() });
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(cred_err)?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(vec![cred.cert().clone()], cred.private_key())
        .map_err(cred_err)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let qcc = QuicClientConfig::try_from(tls).map_err(cred_err)?;
    let mut cc = quinn::ClientConfig::new(Arc::new(qcc));
    cc.transport_config(Arc::new(transport_config()));
    Ok(cc)
}

fn bind_socket(addr: SocketAddr) -> Result<std::net::UdpSocket, RpcError> {
    let domain = if addr.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
    let sock = socket2::Socket::new(domain, socket2::Type::DGRAM, Some(socket2::Protocol::UDP))?;
    // Larger socket buffers matter on real networks; the kernel caps them at rmem_max/wmem_max.
    let _ = sock.set_recv_buffer_size(8 << 20);
    let _ = sock.set_send_buffer_size(8 << 20);
    sock.bind(&addr.into()).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            RpcError::Connect { addr, reason: format!("UDP port {} is already in use", addr.port()) }
        } else {
            RpcError::Connect { addr, reason: format!("cannot bind: {e}") }
        }
    })?;
    Ok(sock.into())
}

/// A QUIC endpoint that serves a router (when bound as a server) and makes outgoing connections.
#[derive(Clone)]
pub struct QuicEndpoint {
    endpoint: quinn::Endpoint,
}

impl QuicEndpoint {
    /// An endpoint for outgoing connections only.
    pub fn client(cred: &JobCredential, bind: SocketAddr) -> Result<QuicEndpoint, RpcError> {
        let sock = bind_socket(bind)?;
        let runtime = quinn::default_runtime().ok_or_else(|| RpcError::Credential("no async runtime".into()))?;
        let mut endpoint = quinn::Endpoint::new(endpoint_config(cred), None, sock, runtime)?;
        endpoint.set_default_client_config(client_config(cred)?);
        Ok(QuicEndpoint { endpoint })
    }

    /// An endpoint that accepts connections on `bind` and also connects out.
    pub fn server(cred: &JobCredential, bind: SocketAddr) -> Result<QuicEndpoint, RpcError> {
        let sock = bind_socket(bind)?;
        let runtime = quinn::default_runtime().ok_or_else(|| RpcError::Credential("no async runtime".into()))?;
        let mut endpoint = quinn::Endpoint::new(endpoint_config(cred), Some(server_config(cred)?), sock, runtime)?;
        endpoint.set_default_client_config(client_config(cred)?);
        Ok(QuicEndpoint { endpoint })
    }

    pub fn local_addr(&self) -> Result<SocketAddr, RpcError> {
        Ok(self.endpoint.local_addr()?)
    }

    /// Connects to `addr` and opens the stream that carries requests.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Conn, RpcError> {
        let connecting =
            self.endpoint.connect(addr, SERVER_NAME).map_err(|e| RpcError::Connect { addr, reason: e.to_string() })?;
        let conn = connecting.await.map_err(|e| handshake_error(addr, e))?;
        let (send, recv) = conn.open_bi().await.map_err(|e| RpcError::Connect { addr, reason: e.to_string() })?;
        let label = format!("quic {addr}");
        let c = Conn::new(recv, send, label);
        c.hold(conn);
        Ok(c)
    }

    /// Accepts connections until shutdown; each stream a peer opens carries requests to `router`.
    pub async fn serve(&self, router: Arc<Router>, mut shutdown: Shutdown) {
        loop {
            let incoming = tokio::select! {
                i = self.endpoint.accept() => i,
                _ = shutdown.changed() => break,
            };
            let Some(incoming) = incoming else { break };
            let router = router.clone();
            tokio::spawn(async move {
                let remote = incoming.remote_address();
                let conn = match incoming.await {
                    Ok(c) => c,
                    Err(e) => {
                        warn!(peer = %remote, error = %e, "refused QUIC connection");
                        return;
                    }
                };
                debug!(peer = %remote, "accepted QUIC connection");
                loop {
                    match conn.accept_bi().await {
                        Ok((send, recv)) => {
                            let router = router.clone();
                            tokio::spawn(async move { crate::router::serve_stream(router, recv, send).await });
                        }
                        Err(e) => {
                            debug!(peer = %remote, error = %e, "QUIC connection ended");
                            break;
                        }
                    }
                }
            });
        }
        self.endpoint.close(0u32.into(), b"shutdown");
        info!("QUIC endpoint closed");
    }

    /// Closes every connection of this endpoint.
    pub fn close(&self) {
        self.endpoint.close(0u32.into(), b"shutdown");
    }
}

/// A failed QUIC handshake: a TLS failure (either side refused the other's certificate — a
/// credential of another job, or none) is a `Credential` error, which no caller retries; the
/// rest (no answer, refused, reset) may pass.
fn handshake_error(addr: SocketAddr, e: quinn::ConnectionError) -> RpcError {
    let tls = |code: quinn::TransportErrorCode| (0x100..0x200).contains(&u64::from(code));
    match &e {
        quinn::ConnectionError::TransportError(t) if tls(t.code) => {
            RpcError::Credential(format!("the handshake with {addr} failed: {e}"))
        }
        quinn::ConnectionError::ConnectionClosed(c) if tls(c.error_code) => RpcError::Credential(format!(
            "{addr} refused this job's credential (it serves another job, or this config is another job's): {e}"
        )),
        _ => RpcError::Connect { addr, reason: e.to_string() },
    }
}
