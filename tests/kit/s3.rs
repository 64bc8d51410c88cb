//! The S3 side of the test kit: a real S3-compatible server on loopback (`s3s-fs`, which keeps
//! objects as files and so survives a restart; `moto_server`, which accepts any key), killed
//! and restarted at will, and a proxy that answers a fraction of requests with
//! `503 SlowDown`, as a throttled store does.
//!
//! scripts/test installs both servers; when one is missing the test fails saying so.

use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const ACCESS_KEY: &str = "odfstestkey";
pub const SECRET_KEY: &str = "odfstestsecret";

/// An AWS shared credentials file with the test server's keys as the default profile.
pub fn credentials_file_text() -> String {
    format!("[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
}

fn free_port(host: IpAddr) -> u16 {
    TcpListener::bind((host, 0)).expect("bind").local_addr().expect("addr").port()
}

fn wait_listening(host: IpAddr, port: u16, child: &mut Child, what: &str, log: &Path) {
    let t = Instant::now();
    while TcpStream::connect((host, port)).is_err() {
        if let Ok(Some(st)) = child.try_wait() {
            panic!("{what} exited ({st}) before listening:\n{}", std::fs::read_to_string(log).unwrap_or_default());
        }
        assert!(t.elapsed() < Duration::from_secs(30), "{what} not listening on port {port} within 30 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A running S3-compatible server.
pub struct S3Server {
    child: Option<Child>,
    /// Address it listens on (loopback unless made with `s3s_on`).
    pub host: IpAddr,
    pub port: u16,
    /// s3s-fs: objects live at `dir/<bucket>/<key>`.
    pub dir: PathBuf,
    moto: bool,
    log: PathBuf,
}

impl S3Server {
    /// `s3s-fs` over `dir` with the kit's credentials; `buckets` are created as directories.
    pub fn s3s(dir: &Path, buckets: &[&str]) -> S3Server {
        Self::s3s_on(dir, buckets, IpAddr::from([127, 0, 0, 1]))
    }

    /// `s3s-fs` listening on `host` (e.g. a bridge that test nodes in network namespaces reach).
    pub fn s3s_on(dir: &Path, buckets: &[&str], host: IpAddr) -> S3Server {
        for b in buckets {
            std::fs::create_dir_all(dir.join(b)).expect("bucket directory");
        }
        let mut s = S3Server {
            child: None,
            host,
            port: free_port(host),
            dir: dir.to_path_buf(),
            moto: false,
            log: dir.with_extension("log"),
        };
        s.start();
        s
    }

    /// `moto_server` (in memory; any key is accepted, as some stores do).
    pub fn moto(log_dir: &Path) -> S3Server {
        let host = IpAddr::from([127, 0, 0, 1]);
        let mut s = S3Server {
            child: None,
            host,
            port: free_port(host),
            dir: PathBuf::new(),
            moto: true,
            log: log_dir.join("moto.log"),
        };
        s.start();
        s
    }

    /// Starts the server (again, on the same port and data).
    pub fn start(&mut self) {
        let log = std::fs::File::create(&self.log).expect("server log");
        let mut cmd = if self.moto {
            let mut c = Command::new("moto_server");
            c.args(["-H", "127.0.0.1", "-p", &self.port.to_string()]);
            c
        } else {
            let mut c = Command::new("s3s-fs");
            c.args(["--host", &self.host.to_string(), "--port", &self.port.to_string()])
                .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
                .arg(&self.dir);
            c
        };
        let name = if self.moto { "moto_server (pip install 'moto[server]')" } else { "s3s-fs (cargo install s3s-fs)" };
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}; scripts/test installs it: {e}"));
        wait_listening(self.host, self.port, &mut child, name, &self.log);
        self.child = Some(child);
    }

    /// `kill -9` of the server.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}:{}", self.host, self.port)
    }

    /// Environment for `odfs stage-*` and other S3 clients: the kit's credentials and region.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.into()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_EC2_METADATA_DISABLED", "true".into()),
        ]
    }

    /// The file holding an object of an s3s-fs server.
    pub fn object_path(&self, bucket: &str, key: &str) -> PathBuf {
        self.dir.join(bucket).join(key)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An HTTP proxy in front of an S3 server that answers about `percent`% of requests with
/// `503 SlowDown` (after reading the whole request) and passes the rest through. One request
/// per connection: every response carries `Connection: close`.
pub struct ThrottleProxy {
    pub port: u16,
    pub throttled: Arc<AtomicU64>,
    pub passed: Arc<AtomicU64>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl ThrottleProxy {
    pub fn start(upstream: u16, percent: u64) -> ThrottleProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        let throttled = Arc::new(AtomicU64::new(0));
        let passed = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (t, p, s) = (throttled.clone(), passed.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n: u64 = 0;
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        n += 1;
                        // A fixed, spread-out pattern: reproducible, never two in a row.
                        let throttle = (n * 37) % 100 < percent;
                        let (t, p) = (t.clone(), p.clone());
                        std::thread::spawn(move || {
                            let _ = serve(conn, upstream, throttle, &t, &p);
                        });
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(2)),
                    Err(_) => break,
                }
            }
        });
        ThrottleProxy { port, throttled, passed, stop }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for ThrottleProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Reads an HTTP head (through the blank line); returns it and any body bytes read past it.
fn read_head(s: &mut TcpStream) -> std::io::Result<(String, Vec<u8>)> {
    use std::io::Read;
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    loop {
        let n = s.read(&mut tmp)?;
        if n == 0 {
            return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "closed before a full head"));
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(i + 4);
            return Ok((String::from_utf8_lossy(&buf).into_owned(), rest));
        }
    }
}

fn content_length(head: &str) -> u64 {
    head.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case("content-length").then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0)
}

/// The head without hop-by-hop `Connection` headers, with `Connection: close` added.
fn closing(head: &str) -> String {
    let mut out: Vec<&str> = head
        .trim_end_matches("\r\n\r\n")
        .split("\r\n")
        .filter(|l| !l.to_ascii_lowercase().starts_with("connection:"))
        .collect();
    out.push("Connection: close");
    format!("{}\r\n\r\n", out.join("\r\n"))
}

fn serve(mut client: TcpStream, upstream: u16, throttle: bool, t: &AtomicU64, p: &AtomicU64) -> std::io::Result<()> {
    use std::io::{Read, Write};
    client.set_nonblocking(false)?;
    let (head, mut body) = read_head(&mut client)?;
    let want = content_length(&head) as usize;
    while body.len() < want {
        let mut tmp = vec![0u8; (want - body.len()).min(1 << 20)];
        let n = client.read(&mut tmp)?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&tmp[..n]);
    }
    if throttle {
        t.fetch_add(1, Ordering::Relaxed);
        let xml = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\
                   <Message>Please reduce your request rate.</Message></Error>";
        let resp = format!(
            "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{xml}",
            xml.len()
        );
        client.write_all(resp.as_bytes())?;
        return Ok(());
    }
    p.fetch_add(1, Ordering::Relaxed);
    let mut up = TcpStream::connect(SocketAddr::from(([127, 0, 0, 1], upstream)))?;
    up.write_all(closing(&head).as_bytes())?;
    up.write_all(&body)?;
    let (rhead, rest) = read_head(&mut up)?;
    client.write_all(closing(&rhead).as_bytes())?;
    client.write_all(&rest)?;
    std::io::copy(&mut up, &mut client)?;
    Ok(())
}
