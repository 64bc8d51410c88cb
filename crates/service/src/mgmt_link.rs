//! A daemon's link to mgmtd: register, then heartbeat with fresh target space; re-register when
//! mgmtd forgets the service (a restarted mgmtd).

use odfs_proto::mgmt::{Heartbeat, Register, RegisterReply, TargetSpace};
use odfs_proto::{RequestHeader, TargetId};
use odfs_rpc::{Pool, RpcError, Shutdown, Transport};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// Reports current target space at each heartbeat.
pub type SpaceProbe = Arc<dyn Fn() -> Vec<(TargetId, TargetSpace)> + Send + Sync>;

pub struct MgmtLink {
    pub pool: Arc<Pool>,
    pub mgmtd: SocketAddr,
    pub register: Register,
}

impl MgmtLink {
    fn header() -> RequestHeader {
        RequestHeader::default()
    }

    /// Registers, retrying until `deadline`.
    pub async fn register(&self, deadline: Duration) -> Result<RegisterReply, RpcError> {
        let start = std::time::Instant::now();
        loop {
            match self.pool.call(self.mgmtd, Transport::Quic, &Self::header(), &self.register).await {
                Ok(r) => return Ok(r),
                Err(e) if e.retryable() && start.elapsed() < deadline => {
                    warn!(error = %e, "mgmtd not reachable yet");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Heartbeats until shutdown, then unregisters.
    pub async fn run(self, first: RegisterReply, probe: SpaceProbe, mut shutdown: Shutdown) {
        let (mut id, mut incarnation) = (first.service_id, first.incarnation);
        let mut every = Duration::from_millis(first.heartbeat_ms.max(50));
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = shutdown.changed() => break,
            }
            let hb = Heartbeat { service_id: id, targets: probe(), incarnation };
            match self.pool.call(self.mgmtd, Transport::Quic, &Self::header(), &hb).await {
                Ok(r) if r.known => {}
                Ok(_) => {
                    info!("mgmtd does not know this service; registering again");
                    let mut reg = self.register.clone();
                    for t in reg.targets.iter_mut() {
                        if let Some((_, s)) = hb.targets.iter().find(|(id, _)| *id == t.id) {
                            t.space = *s;
                        }
                    }
                    if let Ok(r) = self.pool.call(self.mgmtd, Transport::Quic, &Self::header(), &reg).await {
                        (id, incarnation) = (r.service_id, r.incarnation);
                        every = Duration::from_millis(r.heartbeat_ms.max(50));
                    }
                }
                Err(e) => warn!(error = %e, "heartbeat failed"),
            }
        }
        // A courtesy: mgmtd may be stopping too (a job's teardown), and then nothing answers.
        let _ = tokio::time::timeout(
            Duration::from_millis(250),
            self.pool.call(
                self.mgmtd,
                Transport::Quic,
                &Self::header(),
                &odfs_proto::mgmt::Unregister { service_id: id },
            ),
        )
        .await;
    }
}
