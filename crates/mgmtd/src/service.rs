//! Wire adapter: mgmtd's requests to registry calls.

use crate::registry::Registry;
use odfs_proto::mgmt::*;
use odfs_proto::RequestHeader;
use odfs_rpc::Router;
use std::sync::Arc;

pub fn router(reg: Arc<Registry>) -> Router {
    let mut r = Router::new();
    let g = reg.clone();
    r.add::<Register, _, _>(move |_h: RequestHeader, req| {
        let g = g.clone();
        async move { Ok(g.register(req)) }
    });
    let g = reg.clone();
    r.add::<Heartbeat, _, _>(move |_h, req| {
        let g = g.clone();
        async move { Ok(g.heartbeat(req)) }
    });
    let g = reg.clone();
    r.add::<Unregister, _, _>(move |_h, req: Unregister| {
        let g = g.clone();
        async move {
            g.unregister(req.service_id);
            Ok(())
        }
    });
    let g = reg.clone();
    r.add::<GetCluster, _, _>(move |_h, _req| {
        let g = g.clone();
        async move { Ok(g.view()) }
    });
    let g = reg.clone();
    r.add::<ReportNode, _, _>(move |_h, req: ReportNode| {
        let g = g.clone();
        async move {
            g.report_node(req);
            Ok(())
        }
    });
    let g = reg.clone();
    r.add::<SetVerdict, _, _>(move |_h, req: SetVerdict| {
        let g = g.clone();
        async move {
            g.set_verdict(req.verdict);
            Ok(())
        }
    });
    let g = reg.clone();
    r.add::<GetBoard, _, _>(move |_h, _req| {
        let g = g.clone();
        async move { Ok(g.board()) }
    });
    // Pools are the site's and the filesystem owner's to shape; the caller's word is its
    // header (as everywhere in a job: whoever holds the job's credential is trusted).
    let g = reg;
    r.add::<ChangePool, _, _>(move |_h, req: ChangePool| {
        let g = g.clone();
        async move { g.change_pool(req) }
    });
    r
}
