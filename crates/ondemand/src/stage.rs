//! `odfs stage-in SRC DST` and `odfs stage-out SRC DST`: a stage request from the command line,
//! run as the caller over the filesystem's client, its report printed; the exit status says
//! whether every file was copied and verified. And `odfs drain start|status|stop`: a job's
//! continuous drains, which run on node 0's stage agent. The work is `odfs_stage`'s.

use crate::fsref;
use anyhow::Result;
use odfs_client::Ctx;
use odfs_stage::drain::{self, DrainRequest};
use odfs_stage::{request, Direction, StageRequest};

/// Runs a stage; prints the report; fails (non-zero exit) when any file failed or any source
/// name was refused.
///
/// SIGINT (Ctrl-C), SIGTERM and SIGHUP stop a stage-in: what it verified is recorded in its
/// manifest, it says so, and the process exits with 128 + the signal's number.
pub async fn run(fs: Option<&std::path::Path>, r: &StageRequest, way: Direction) -> Result<()> {
    let client = fsref::connect(fs).await?;
    let mut r = r.clone();
    let (stop, signals) = match way {
        Direction::In => {
            let (tx, rx) = tokio::sync::watch::channel(false);
            r.interrupted = Some(rx);
            (Some(tx), Some(tokio::spawn(first_signal())))
        }
        Direction::Out => (None, None),
    };
    let signalled = async {
        match signals {
            Some(s) => s.await.unwrap_or(None),
            None => std::future::pending().await,
        }
    };
    let ctx = Ctx::current();
    let work = request::run(&client, &ctx, &r, way);
    tokio::pin!(work, signalled);
    let (report, signal) = tokio::select! {
        report = &mut work => (report, None),
        sig = &mut signalled => {
            if let Some(tx) = &stop {
                let _ = tx.send(true);
            }
            eprintln!("odfs: interrupted: recording what is verified (a second signal ends at once, recording nothing more)");
            tokio::select! {
                report = &mut work => (report, sig),
                again = first_signal() => std::process::exit(128 + again.or(sig).unwrap_or(2)),
            }
        }
    };
    client.close().await;
    if let (Err(e), Some(sig)) = (&report, signal) {
        eprintln!("odfs: {e}");
        std::process::exit(128 + sig);
    }
    let report = report?;
    println!("{}", report.summary());
    if let Some(w) = report.warning() {
        eprintln!("odfs: warning: {w}");
    }
    Ok(request::check(&report)?)
}

/// The number of the first of SIGINT, SIGTERM and SIGHUP this process gets (None if they
/// cannot be listened for).
async fn first_signal() -> Option<i32> {
    use tokio::signal::unix::{signal, SignalKind};
    let (int, term, hup) = (SignalKind::interrupt(), SignalKind::terminate(), SignalKind::hangup());
    let (mut i, mut t, mut h) = (signal(int).ok()?, signal(term).ok()?, signal(hup).ok()?);
    let got = tokio::select! {
        _ = i.recv() => int,
        _ = t.recv() => term,
        _ = h.recv() => hup,
    };
    Some(got.as_raw_value())
}

/// `odfs drain start SRC DST`: starts draining SRC on node 0's agent, as the caller.
pub async fn drain_start(fs: Option<&std::path::Path>, r: &DrainRequest) -> Result<()> {
    let client = fsref::connect(fs).await?;
    let started = drain::start(&client, &Ctx::current(), r).await;
    client.close().await;
    let s = started?;
    println!(
        "drain started: odfs:{} -> {} (settle {:.1} s{}); `odfs drain status` shows its progress",
        s.src,
        r.dst,
        s.settle_ms as f64 / 1000.0,
        if s.keep > 0 { format!(", keeping the last {}", s.keep) } else { String::new() }
    );
    Ok(())
}

/// `odfs drain status`: every drain of the job, one line each (or JSON).
pub async fn drain_status(fs: Option<&std::path::Path>, json: bool) -> Result<()> {
    let client = fsref::connect(fs).await?;
    let states = drain::list(&client, &Ctx::current()).await;
    client.close().await;
    print_drains(&states?, json, "no drain has been started in this filesystem")
}

/// `odfs drain stop [SRC]`: stops one drain (every drain without SRC) after its pass in flight.
pub async fn drain_stop(fs: Option<&std::path::Path>, src: Option<&str>, json: bool) -> Result<()> {
    let src = match src {
        None => None,
        Some(s) => match odfs_stage::location::parse(s, &odfs_stage::location::odfs_mounts())? {
            odfs_stage::Location::Odfs(p) => Some(p),
            other => anyhow::bail!("{other} is not a directory of the filesystem (odfs:/PATH or a path in the mount)"),
        },
    };
    let client = fsref::connect(fs).await?;
    let states = drain::stop(&client, &Ctx::current(), src.clone()).await;
    client.close().await;
    let states = states?;
    if let (Some(src), true) = (&src, states.is_empty()) {
        anyhow::bail!("no drain of odfs:{src} is running");
    }
    print_drains(&states, json, "no drain was running")
}

fn print_drains(states: &[odfs_proto::stage::DrainState], json: bool, none: &str) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(states)?);
    } else if states.is_empty() {
        println!("{none}");
    } else {
        for s in states {
            println!("{}", drain::describe(s));
        }
    }
    Ok(())
}
