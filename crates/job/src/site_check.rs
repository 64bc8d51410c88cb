//! What `odfs site-config` checks on the node it runs on, beyond the file's syntax: that the
//! config can work there — the site key loads, the data paths, the state directory and the
//! mount point can be created, the stage credentials and config files exist, and the S3
//! endpoint resolves and accepts connections. Each problem is one line naming the key.

use crate::site::{expand, SiteConfig};
use odfs_rpc::SiteKey;
use std::net::{TcpStream, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

/// How long the endpoint check waits for a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Every problem of `cfg` on node `node`, one line each; empty when the config can work here.
/// `connect`: also open a TCP connection to the S3 endpoint.
pub fn check_node(cfg: &SiteConfig, node: &str, connect: bool) -> Vec<String> {
    let o = &cfg.ondemand;
    let mut problems = Vec::new();
    if let Err(e) = SiteKey::load(&o.site_key) {
        problems.push(format!(
            "[ondemand] site_key {}: {e} (make it once with `odfs keygen --out {}`, then copy it to every node)",
            o.site_key.display(),
            o.site_key.display()
        ));
    }
    for p in &o.data_paths {
        problems.extend(creatable_dir("[ondemand] data_paths", &expand(p, "", "", node)));
    }
    problems.extend(creatable_dir("[ondemand] state_dir", &expand(&o.state_dir, "", "", node)));
    problems.extend(creatable_dir("[ondemand] mount", &fixed_prefix(&expand(&o.mount, "%j", "%u", node))));
    let s = &cfg.stage;
    for (key, f, e) in s.unreadable_files() {
        problems.push(format!("[stage] {key} {}: {e}", f.display()));
    }
    if let Some(url) = &s.endpoint_url {
        problems.extend(endpoint(url, connect).err().map(|e| format!("[stage] endpoint_url {url}: {e}")));
    }
    problems
}

/// The directory part of a pattern before its first per-job placeholder.
fn fixed_prefix(path: &str) -> String {
    let cut = path.find('%').map_or(path, |i| &path[..i]);
    match cut.rfind('/') {
        Some(0) => "/".into(),
        Some(i) if cut.len() != path.len() => cut[..i].into(),
        _ => cut.into(),
    }
}

/// A problem if `path` is not a writable directory and cannot be made one: its nearest
/// existing ancestor must be a writable directory.
fn creatable_dir(key: &str, path: &str) -> Option<String> {
    let mut at = Path::new(path);
    loop {
        match std::fs::metadata(at) {
            Ok(m) if !m.is_dir() => {
                return Some(format!("{key} {path}: {} exists and is not a directory", at.display()))
            }
            Ok(_) => {
                return nix::unistd::access(at, nix::unistd::AccessFlags::W_OK)
                    .err()
                    .map(|e| format!("{key} {path}: cannot create it in {}: {}", at.display(), e.desc()));
            }
            // Missing, or below a file (ENOTDIR): the walk up finds what is in the way.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ENOTDIR) => {
                match at.parent() {
                    Some(p) => at = p,
                    None => return Some(format!("{key} {path}: no existing directory above it")),
                }
            }
            Err(e) => return Some(format!("{key} {path}: {}: {e}", at.display())),
        }
    }
}

/// Resolves the endpoint's host and, with `connect`, connects to it.
fn endpoint(url: &str, connect: bool) -> Result<(), String> {
    let (scheme, rest) = url.split_once("://").ok_or("not a URL (http://HOST[:PORT])")?;
    let port = match scheme {
        "http" => 80,
        "https" => 443,
        _ => return Err(format!("scheme {scheme:?} is neither http nor https")),
    };
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !p.contains(']') => (h, p.parse::<u16>().map_err(|_| format!("bad port {p:?}"))?),
        _ => (authority, port),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err("no host".into());
    }
    let addrs: Vec<_> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("host {host} does not resolve on this node ({e})"))?
        .collect();
    let first = addrs.first().ok_or_else(|| format!("host {host} has no address"))?;
    if connect {
        TcpStream::connect_timeout(first, CONNECT_TIMEOUT)
            .map_err(|e| format!("cannot connect to {first} from this node ({e})"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A config whose every path lies under `d`, with a valid site key.
    fn good(d: &Path) -> SiteConfig {
        let mut cfg = SiteConfig::default();
        let key = d.join("site.key");
        SiteKey::generate().write_new(&key).unwrap();
        cfg.ondemand.site_key = key;
        cfg.ondemand.data_paths = vec![d.join("nvme0/odfs-%n").display().to_string()];
        cfg.ondemand.state_dir = d.join("state/%n").display().to_string();
        cfg.ondemand.mount = d.join("mnt/odfs/%j").display().to_string();
        cfg
    }

    #[test]
    fn a_config_that_can_work_has_no_problems() {
        let d = tempfile::tempdir().unwrap();
        let mut cfg = good(d.path());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        cfg.stage.endpoint_url = Some(format!("http://{}/", listener.local_addr().unwrap()));
        assert_eq!(check_node(&cfg, "n1", true), Vec::<String>::new());
    }

    #[test]
    fn what_cannot_work_is_named() {
        let d = tempfile::tempdir().unwrap();
        let mut cfg = good(d.path());
        cfg.ondemand.site_key = d.path().join("missing.key");
        std::fs::write(d.path().join("file"), b"x").unwrap();
        cfg.ondemand.data_paths = vec![d.path().join("file/odfs").display().to_string()];
        cfg.stage.credentials_file = Some(d.path().join("s3.credentials"));
        cfg.stage.endpoint_url = Some("http://s3.invalid:9000".into());
        let problems = check_node(&cfg, "n1", false);
        let has = |key: &str, what: &str| {
            assert!(problems.iter().any(|p| p.starts_with(key) && p.contains(what)), "{key} {what}: {problems:#?}")
        };
        has("[ondemand] site_key", "odfs keygen");
        has("[ondemand] data_paths", "is not a directory");
        has("[stage] credentials_file", "No such file");
        has("[stage] endpoint_url http://s3.invalid:9000", "does not resolve");
        assert_eq!(problems.len(), 4, "{problems:#?}");
    }

    #[test]
    fn a_directory_that_cannot_be_created_is_named() {
        if nix::unistd::geteuid().is_root() {
            // Root may write anywhere: a directory without write permission is made by
            // putting a file where a parent directory would have to be instead.
            let d = tempfile::tempdir().unwrap();
            let cfg = good(d.path());
            std::fs::write(d.path().join("state"), b"").unwrap();
            let problems = check_node(&cfg, "n1", false);
            assert!(problems.iter().any(|p| p.starts_with("[ondemand] state_dir")), "{problems:#?}");
        } else {
            let d = tempfile::tempdir().unwrap();
            let cfg = good(d.path());
            std::fs::create_dir(d.path().join("state")).unwrap();
            std::fs::set_permissions(d.path().join("state"), std::fs::Permissions::from_mode(0o555)).unwrap();
            let problems = check_node(&cfg, "n1", false);
            assert!(problems.iter().any(|p| p.contains("cannot create it")), "{problems:#?}");
        }
    }

    #[test]
    fn endpoints_are_parsed_before_they_are_resolved() {
        assert!(endpoint("s3.example.org", false).unwrap_err().contains("not a URL"));
        assert!(endpoint("ftp://h", false).unwrap_err().contains("scheme"));
        assert!(endpoint("http://h:port/", false).unwrap_err().contains("bad port"));
        endpoint("http://127.0.0.1:9000/bucket", false).unwrap();
        endpoint("https://user@[::1]/", false).unwrap();
    }

    #[test]
    fn a_mount_pattern_is_checked_up_to_its_first_placeholder() {
        assert_eq!(fixed_prefix("/mnt/odfs/%j"), "/mnt/odfs");
        assert_eq!(fixed_prefix("/mnt/odfs-%j"), "/mnt");
        assert_eq!(fixed_prefix("/%u/odfs"), "/");
        assert_eq!(fixed_prefix("/mnt/odfs"), "/mnt/odfs");
    }
}
