//! S3 access for staging: the client built from a [`S3Spec`], listing, ranged and streamed
//! GETs, uploads with server-verified checksums, multipart uploads, and one-line errors.
//!
//! Retries (exponential backoff with jitter on throttling, 5xx and timeouts) are the SDK's
//! standard retry strategy, configured here; callers see only final failures.

use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{
    BehaviorVersion, Credentials, Region, RequestChecksumCalculation, ResponseChecksumValidation,
};
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{ChecksumMode, CompletedMultipartUpload, CompletedPart};
use base64::Engine;
use odfs_proto::stage::{S3Credentials, S3Spec};
use odfs_proto::Timespec;
use std::time::Duration;

/// One object of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    pub key: String,
    pub size: u64,
    pub etag: String,
    pub mtime: Timespec,
}

/// What a HEAD tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub size: u64,
    pub etag: String,
    pub crc32c: Option<String>,
}

/// A staging S3 error: one line naming the problem.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{msg}")]
pub struct S3Error {
    pub msg: String,
    /// The endpoint could not be reached at all (after the SDK's retries): trying the same
    /// item again at once would only wait longer.
    pub unreachable: bool,
}

impl S3Error {
    pub fn new(msg: impl Into<String>) -> S3Error {
        S3Error { msg: msg.into(), unreachable: false }
    }
}

pub type Result<T> = std::result::Result<T, S3Error>;

/// Turns an SDK error into one line naming the problem, with the bucket and key it concerns.
pub fn describe<E: ProvideErrorMetadata + std::error::Error + 'static>(
    e: SdkError<E>,
    spec: &S3Spec,
    what: &str,
) -> S3Error {
    let place = format!("s3://{}/{what}", spec.bucket);
    let endpoint = spec.endpoint_url.as_deref().unwrap_or("the default AWS endpoint");
    let msg = match &e {
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) => {
            // The innermost cause says it plainly ("Connection refused", "timed out").
            let mut cause: &dyn std::error::Error = &e;
            while let Some(next) = cause.source() {
                cause = next;
            }
            let why = if matches!(e, SdkError::TimeoutError(_)) { "timed out".to_string() } else { cause.to_string() };
            format!("cannot reach the S3 endpoint {endpoint}: {why}")
        }
        SdkError::ServiceError(se) => {
            let code = se.err().code().unwrap_or("");
            let status = se.raw().status().as_u16();
            let body = se.raw().body().bytes().unwrap_or_default();
            match code {
                // S3 names its error in the body of every reply that has one; a reply without
                // (but a HEAD's) did not come from S3, or S3 could not say it in XML.
                "" if (200..300).contains(&status) => unreadable_reply(endpoint, &place, body),
                "" if status != 403 && (what.is_empty() || !body.is_empty()) => not_s3(endpoint, status),
                "NoSuchBucket" => format!("bucket {:?} does not exist at {endpoint}", spec.bucket),
                "InvalidAccessKeyId" | "SignatureDoesNotMatch" | "InvalidToken" | "ExpiredToken" => {
                    format!("S3 refused the credentials ({code}) for {place}: check the credentials (access key and secret)")
                }
                "AccessDenied" => format!("access denied to {place}"),
                "NoSuchKey" => format!("{place} does not exist"),
                _ if status == 404 && what.is_empty() => {
                    format!("bucket {:?} does not exist at {endpoint}", spec.bucket)
                }
                _ if status == 403 => format!("S3 refused {place} (HTTP 403): check the credentials"),
                _ => format!("{place}: {} (HTTP {status})", se.err().message().unwrap_or(code)),
            }
        }
        SdkError::ResponseError(re) => unreadable_reply(endpoint, &place, re.raw().body().bytes().unwrap_or_default()),
        _ => format!("{place}: {}", DisplayErrorContext(&e)),
    };
    S3Error { msg, unreachable: matches!(e, SdkError::DispatchFailure(_) | SdkError::TimeoutError(_)) }
}

/// An error reply that names no S3 error: the endpoint is some other HTTP server.
fn not_s3(endpoint: &str, status: u16) -> String {
    format!(
        "the endpoint {endpoint} did not answer as S3 does (HTTP {status} without an S3 error): \
         check --endpoint-url (or endpoint_url), and that it is an S3 server's address"
    )
}

/// A success reply the SDK could not read. A listing naming a key that XML cannot carry (a
/// NUL or another control character; S3 accepts any UTF-8 in a key) is the likely cause, and
/// the key is named, escaped.
fn unreadable_reply(endpoint: &str, place: &str, body: &[u8]) -> String {
    match unreadable_key(body) {
        Some(key) => format!(
            "{place}: the listing holds the key {} which has a character an S3 listing cannot \
             carry: odfs cannot stage it; rename or delete that object",
            key.escape_default()
        ),
        None => format!("{place}: the reply of {endpoint} could not be read as S3's: is it an S3 server?"),
    }
}

/// The first `<Key>` of a listing reply whose text holds a character XML 1.0 forbids, as a
/// raw byte or as a character reference.
fn unreadable_key(body: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(body);
    text.split("<Key>").skip(1).filter_map(|rest| rest.split_once("</Key>").map(|(k, _)| k)).find_map(|raw| {
        let key = unescape_xml(raw);
        key.chars().any(|c| c.is_control() && !matches!(c, '\t' | '\n' | '\r')).then_some(key)
    })
}

/// XML's five named entities and numeric character references, kept as written where they do
/// not decode.
fn unescape_xml(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let Some(end) = rest.find(';') else { break };
        let decoded = match &rest[1..end] {
            "amp" => Some('&'),
            "lt" => Some('<'),
            "gt" => Some('>'),
            "quot" => Some('"'),
            "apos" => Some('\''),
            e => match e.strip_prefix("#x") {
                Some(h) => u32::from_str_radix(h, 16).ok(),
                None => e.strip_prefix('#').and_then(|d| d.parse::<u32>().ok()),
            }
            .and_then(char::from_u32),
        };
        match decoded {
            Some(c) => {
                out.push(c);
                rest = &rest[end + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Resolves credentials: the ones given, else the AWS chain of environment variables, then
/// shared config and credentials files (profiles, `credential_process`).
pub async fn resolve_credentials(given: Option<S3Credentials>) -> Result<S3Credentials> {
    if let Some(c) = given {
        return Ok(c);
    }
    use aws_sdk_s3::config::ProvideCredentials;
    // Environment, then profiles (files, SSO-less, credential_process). The instance metadata
    // service is left out on purpose: a compute node that is not a cloud instance would send
    // requests to a link-local address nobody serves; wrap instance roles in a profile's
    // credential_process where they exist.
    let chain = aws_config::meta::credentials::CredentialsProviderChain::first_try(
        "Environment",
        aws_config::environment::EnvironmentVariableCredentialsProvider::new(),
    )
    .or_else("Profile", aws_config::profile::ProfileFileCredentialsProvider::builder().build());
    let c = chain.provide_credentials().await.map_err(|_| S3Error::new(no_credentials()))?;
    Ok(S3Credentials {
        access_key_id: c.access_key_id().to_string(),
        secret_access_key: c.secret_access_key().to_string(),
        session_token: c.session_token().map(str::to_string),
    })
}

/// Why no credentials were found, naming where they were looked for. The provider chain's own
/// error is left out: it is a debug dump of every attempt.
fn no_credentials() -> String {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let profile = var("AWS_PROFILE").unwrap_or_else(|| "default".into());
    let (file, exists) = match var("AWS_SHARED_CREDENTIALS_FILE") {
        Some(f) => {
            let exists = std::path::Path::new(&f).exists();
            (f, exists)
        }
        None => ("~/.aws/credentials".into(), true),
    };
    let missing = if exists { "" } else { " (which does not exist)" };
    format!(
        "no S3 credentials found: none in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), \
         and no keys for profile {profile:?} in the credentials file {file}{missing} or the AWS config file"
    )
}

/// The region: the one given, else AWS_REGION / AWS_DEFAULT_REGION, the profile's, else us-east-1.
pub async fn resolve_region(given: Option<String>) -> String {
    if let Some(r) = given {
        return r;
    }
    // Environment, then the profile; not the instance metadata service (see above).
    use aws_config::meta::region::ProvideRegion;
    if let Some(r) = aws_config::environment::EnvironmentVariableRegionProvider::new().region().await {
        return r.to_string();
    }
    let profile = aws_config::profile::ProfileFileRegionProvider::builder().build();
    profile.region().await.map(|r| r.to_string()).unwrap_or_else(|| "us-east-1".into())
}

/// A client for one bucket.
#[derive(Clone)]
pub struct S3 {
    pub spec: S3Spec,
    client: aws_sdk_s3::Client,
    /// A silent endpoint was announced already (`answered`): once is enough.
    silence_told: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// How long a request without a body (a listing page, a HEAD) waits for an answer before the
/// wait is announced: the SDK's own read timeout (60 s, a minute a byte may take in a large
/// body) times its attempts once left a silent endpoint unannounced for 485 s.
const SILENCE_TOLD_AFTER: Duration = Duration::from_secs(3);

impl S3 {
    pub fn new(spec: &S3Spec) -> S3 {
        let mut b = aws_sdk_s3::config::Builder::new()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(spec.region.clone()))
            .force_path_style(spec.path_style)
            .retry_config(
                RetryConfig::standard()
                    .with_max_attempts(spec.max_attempts.max(1))
                    .with_initial_backoff(Duration::from_millis(100))
                    .with_max_backoff(Duration::from_secs(10)),
            )
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(5))
                    .read_timeout(Duration::from_secs(60))
                    .build(),
            )
            // Checksums are computed and sent by odfs itself (Content-MD5, CRC32C), the same
            // way for every S3-compatible server.
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired);
        if let Some(c) = &spec.credentials {
            b = b.credentials_provider(Credentials::new(
                &c.access_key_id,
                &c.secret_access_key,
                c.session_token.clone(),
                None,
                "odfs",
            ));
        }
        if let Some(url) = &spec.endpoint_url {
            b = b.endpoint_url(url);
        }
        S3 { spec: spec.clone(), client: aws_sdk_s3::Client::from_conf(b.build()), silence_told: Default::default() }
    }

    pub fn key(&self, rel: &str) -> String {
        format!("{}{rel}", self.spec.prefix)
    }

    /// Runs `op` again while the endpoint cannot be reached at all, with exponential backoff
    /// and jitter, until `unreachable_secs` have passed since the first failure; any other
    /// outcome is returned as it is. The SDK's own retries cover a failed request; this covers
    /// a store that is down for a moment (restarted, failed over) during a stage.
    async fn reachable<T, F, Fut>(&self, op: F) -> Result<T>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let limit = Duration::from_secs(self.spec.unreachable_secs as u64);
        let t0 = std::time::Instant::now();
        let mut backoff = Duration::from_millis(250);
        loop {
            match op().await {
                Err(e) if e.unreachable && t0.elapsed() + backoff <= limit => {
                    tracing::warn!(
                        error = %e.msg,
                        retry_in_ms = backoff.as_millis() as u64,
                        for_secs = limit.as_secs(),
                        "S3 endpoint unreachable, trying again (unreachable_secs)"
                    );
                    let jitter = Duration::from_millis(rand::random::<u64>() % 100);
                    tokio::time::sleep(backoff + jitter).await;
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
                r => return r,
            }
        }
    }

    /// One SDK request about `what` (a key; "" for the bucket): `op` builds and sends it, again
    /// while the endpoint is unreachable ([`Self::reachable`]); its error is described.
    async fn send<T, E, F, Fut>(&self, what: &str, op: F) -> Result<T>
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, SdkError<E>>>,
    {
        self.reachable(|| async { op().await.map_err(|e| describe(e, &self.spec, what)) }).await
    }

    /// Waits for `request`, one without a body, whose answer takes no time to send: after
    /// `SILENCE_TOLD_AFTER` a line says what is waited for and until when, and past
    /// `unreachable_secs` the request fails as unreachable (not tried again).
    async fn answered<T>(&self, what: &str, request: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        let limit = Duration::from_secs(self.spec.unreachable_secs as u64).max(SILENCE_TOLD_AFTER);
        tokio::pin!(request);
        if let Ok(r) = tokio::time::timeout(SILENCE_TOLD_AFTER, &mut request).await {
            return r;
        }
        let endpoint = self.spec.endpoint_url.as_deref().unwrap_or("the default AWS endpoint");
        if !self.silence_told.swap(true, std::sync::atomic::Ordering::Relaxed) {
            let until = std::time::SystemTime::now() + (limit - SILENCE_TOLD_AFTER);
            tracing::warn!(
                "the S3 endpoint {endpoint} has not answered {what} for {} s; waiting for it until {} \
                 ({} s in all, --unreachable-secs)",
                SILENCE_TOLD_AFTER.as_secs(),
                odfs_proto::time::utc_clock(until),
                limit.as_secs()
            );
        }
        match tokio::time::timeout(limit - SILENCE_TOLD_AFTER, request).await {
            Ok(r) => r,
            Err(_) => Err(S3Error {
                msg: format!(
                    "the S3 endpoint {endpoint} did not answer {what} within {} s (--unreachable-secs): \
                     is it up, and is it an S3 server?",
                    limit.as_secs()
                ),
                unreachable: true,
            }),
        }
    }

    /// Fails with a clear line unless the bucket exists and the credentials are accepted.
    pub async fn check_bucket(&self) -> Result<()> {
        let what = format!("a request for bucket {:?}", self.spec.bucket);
        // A listing of one key, not a HEAD: its error reply has a body, which tells a missing
        // bucket from an endpoint that is not S3 at all.
        let probe = || self.client.list_objects_v2().bucket(&self.spec.bucket).max_keys(1).send();
        self.answered(&what, self.send("", probe)).await?;
        Ok(())
    }

    /// Every object under `prefix` (all pages).
    pub async fn list(&self, prefix: &str) -> Result<Vec<Object>> {
        self.list_paging(prefix, &|_, _| {}).await
    }

    /// Every object under `prefix`, telling `page` the objects and bytes of each page as it
    /// comes (a listing again after the endpoint was unreachable tells its pages again).
    pub async fn list_paging(&self, prefix: &str, page: &(dyn Fn(u64, u64) + Sync)) -> Result<Vec<Object>> {
        self.reachable(|| self.list_once(prefix, page)).await
    }

    async fn list_once(&self, prefix: &str, seen: &(dyn Fn(u64, u64) + Sync)) -> Result<Vec<Object>> {
        let mut out = Vec::new();
        let mut pages = self.client.list_objects_v2().bucket(&self.spec.bucket).prefix(prefix).into_paginator().send();
        let what = format!("a listing of s3://{}/{prefix}", self.spec.bucket);
        while let Some(page) = self.answered(&what, async { Ok(pages.next().await) }).await? {
            let page = page.map_err(|e| describe(e, &self.spec, prefix))?;
            seen(
                page.contents().len() as u64,
                page.contents().iter().map(|o| o.size().unwrap_or(0).max(0) as u64).sum(),
            );
            for o in page.contents() {
                let mtime = o
                    .last_modified()
                    .map(|t| Timespec { sec: t.secs(), nsec: t.subsec_nanos() })
                    .unwrap_or(Timespec { sec: 0, nsec: 0 });
                out.push(Object {
                    key: o.key().unwrap_or_default().to_string(),
                    size: o.size().unwrap_or(0).max(0) as u64,
                    etag: o.e_tag().unwrap_or_default().trim_matches('"').to_string(),
                    mtime,
                });
            }
        }
        Ok(out)
    }

    /// Size, ETag and (if the server keeps one) CRC32C of one object.
    pub async fn head(&self, key: &str) -> Result<Head> {
        let head = self.send(key, || {
            self.client.head_object().bucket(&self.spec.bucket).key(key).checksum_mode(ChecksumMode::Enabled).send()
        });
        let r = self.answered(&format!("a request for s3://{}/{key}", self.spec.bucket), head).await?;
        let etag = r.e_tag().unwrap_or_default().trim_matches('"').to_string();
        Ok(Head {
            size: r.content_length().unwrap_or(0).max(0) as u64,
            etag,
            crc32c: r.checksum_crc32_c().map(str::to_string),
        })
    }

    /// Fills in ETags a listing left out (some S3-compatible servers list without them) with a
    /// HEAD of each such object, 32 at a time.
    pub async fn fill_etags(&self, objs: &mut [Object]) -> Result<()> {
        use futures::StreamExt;
        let missing: Vec<usize> = (0..objs.len()).filter(|&i| objs[i].etag.is_empty()).collect();
        let heads: Vec<(usize, Result<Head>)> = futures::stream::iter(missing)
            .map(|i| {
                let key = objs[i].key.clone();
                async move { (i, self.head(&key).await) }
            })
            .buffer_unordered(32)
            .collect()
            .await;
        for (i, r) in heads {
            objs[i].etag = r?.etag;
        }
        Ok(())
    }

    /// Starts a GET of `key` (bytes `range` if given). Returns the body, the ETag and the
    /// object's CRC32C if the server keeps one (whole-object GETs only).
    pub async fn get(&self, key: &str, range: Option<(u64, u64)>) -> Result<(ByteStream, String, Option<String>)> {
        let r = self
            .send(key, || {
                let req = self.client.get_object().bucket(&self.spec.bucket).key(key);
                match range {
                    Some((off, len)) => req.range(format!("bytes={off}-{}", off + len - 1)),
                    None => req.checksum_mode(ChecksumMode::Enabled),
                }
                .send()
            })
            .await?;
        let etag = r.e_tag().unwrap_or_default().trim_matches('"').to_string();
        let crc = if range.is_none() { r.checksum_crc32_c().map(str::to_string) } else { None };
        Ok((r.body, etag, crc))
    }

    /// Uploads a whole object with Content-MD5 and CRC32C, which the server checks; returns
    /// the ETag.
    pub async fn put(&self, key: &str, data: Vec<u8>, md5: &[u8; 16], crc: u32) -> Result<String> {
        // Shared, so that another attempt sends the same bytes without a copy.
        let data = bytes::Bytes::from(data);
        let r = self
            .send(key, || {
                self.client
                    .put_object()
                    .bucket(&self.spec.bucket)
                    .key(key)
                    .content_md5(b64(md5))
                    .checksum_crc32_c(b64(&crc.to_be_bytes()))
                    .body(ByteStream::from(data.clone()))
                    .send()
            })
            .await?;
        Ok(r.e_tag().unwrap_or_default().trim_matches('"').to_string())
    }

    pub async fn create_multipart(&self, key: &str) -> Result<String> {
        let r =
            self.send(key, || self.client.create_multipart_upload().bucket(&self.spec.bucket).key(key).send()).await?;
        r.upload_id().map(str::to_string).ok_or_else(|| S3Error::new(format!("{key}: the server gave no upload id")))
    }

    pub async fn upload_part(
        &self,
        key: &str,
        upload_id: &str,
        part: i32,
        data: Vec<u8>,
        md5: &[u8; 16],
    ) -> Result<String> {
        let data = bytes::Bytes::from(data);
        let r = self
            .send(key, || {
                self.client
                    .upload_part()
                    .bucket(&self.spec.bucket)
                    .key(key)
                    .upload_id(upload_id)
                    .part_number(part)
                    .content_md5(b64(md5))
                    .body(ByteStream::from(data.clone()))
                    .send()
            })
            .await?;
        Ok(r.e_tag().unwrap_or_default().trim_matches('"').to_string())
    }

    pub async fn complete_multipart(&self, key: &str, upload_id: &str, parts: &[(i32, String)]) -> Result<String> {
        let r = self
            .send(key, || {
                let parts = parts
                    .iter()
                    .map(|(n, etag)| CompletedPart::builder().part_number(*n).e_tag(etag).build())
                    .collect();
                self.client
                    .complete_multipart_upload()
                    .bucket(&self.spec.bucket)
                    .key(key)
                    .upload_id(upload_id)
                    .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(parts)).build())
                    .send()
            })
            .await?;
        Ok(r.e_tag().unwrap_or_default().trim_matches('"').to_string())
    }

    /// The whole of a small object (a manifest).
    pub async fn get_all(&self, key: &str) -> Result<Vec<u8>> {
        let (body, _, _) = self.get(key, None).await?;
        let data = body.collect().await.map_err(|e| S3Error::new(format!("s3://{}/{key}: {e}", self.spec.bucket)))?;
        Ok(data.into_bytes().to_vec())
    }

    /// Deletes one object (a drain's `--keep` retiring an object it uploaded itself).
    pub async fn delete(&self, key: &str) -> Result<()> {
        self.send(key, || self.client.delete_object().bucket(&self.spec.bucket).key(key).send()).await?;
        Ok(())
    }

    pub async fn abort_multipart(&self, key: &str, upload_id: &str) {
        let _ =
            self.client.abort_multipart_upload().bucket(&self.spec.bucket).key(key).upload_id(upload_id).send().await;
    }
}

pub fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// True for an ETag that is the MD5 of the object (single-part upload, no SSE-KMS): 32 hex digits.
pub fn is_md5_etag(etag: &str) -> bool {
    etag.len() == 32 && etag.bytes().all(|c| c.is_ascii_hexdigit())
}

/// The ETag S3 gives a multipart upload with these part MD5s: MD5 of their concatenation, "-N".
pub fn multipart_etag(part_md5s: &[[u8; 16]]) -> String {
    use md5::{Digest, Md5};
    let mut h = Md5::new();
    for m in part_md5s {
        h.update(m);
    }
    format!("{}-{}", hex::encode(h.finalize()), part_md5s.len())
}

/// Refuses an S3 endpoint URL that cannot be one (`http//host:port`, `ftp://...`, no host, a
/// port that is not a number) with the reason: such a URL never answers, and retrying it as
/// "unreachable" only delays the error.
pub fn check_endpoint_url(url: &str) -> std::result::Result<(), String> {
    let bad = |why: &str| {
        Err(format!("--endpoint-url {url:?} is not an S3 endpoint URL: {why} (expected http://HOST[:PORT] or https://HOST[:PORT])"))
    };
    let Some((scheme, rest)) = url.split_once("://") else { return bad("no scheme") };
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return bad(&format!("the scheme is {scheme:?}"));
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || authority.starts_with('[') => (h, Some(p)),
        _ => (authority, None),
    };
    if host.is_empty() {
        return bad("no host");
    }
    if !host.chars().all(|c| c.is_ascii_alphanumeric() || "-._[]:".contains(c)) {
        return bad(&format!("{host:?} is not a host name or address"));
    }
    if let Some(p) = port {
        if p.parse::<u16>().map_or(true, |n| n == 0) {
            return bad(&format!("the port {p:?} is not a number from 1 to 65535"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etag_forms() {
        assert!(is_md5_etag("9e107d9d372bb6826bd81d3542a419d6"));
        assert!(!is_md5_etag("9e107d9d372bb6826bd81d3542a419d6-3"));
        assert!(!is_md5_etag(""));
        use md5::{Digest, Md5};
        let a: [u8; 16] = Md5::digest(b"a").into();
        let b: [u8; 16] = Md5::digest(b"b").into();
        let mut cat = a.to_vec();
        cat.extend_from_slice(&b);
        assert_eq!(multipart_etag(&[a, b]), format!("{}-2", hex::encode(Md5::digest(&cat))));
    }

    #[test]
    fn a_listing_key_xml_cannot_carry_is_found_and_named_escaped() {
        let page = |keys: &[&str]| {
            let c: String = keys.iter().map(|k| format!("<Contents><Key>{k}</Key><Size>1</Size></Contents>")).collect();
            format!("<?xml version=\"1.0\"?><ListBucketResult><Name>evil</Name>{c}</ListBucketResult>").into_bytes()
        };
        assert_eq!(unreadable_key(&page(&["ds/ok", "ds/a&amp;b"])), None);
        assert_eq!(unreadable_key(&page(&["ds/ok", "ds/a&#0;b"])).as_deref(), Some("ds/a\0b"));
        assert_eq!(unreadable_key(&page(&["ds/a\u{1}b"])).as_deref(), Some("ds/a\u{1}b"));
        assert_eq!(unreadable_key(&page(&["ds/x&#x1F;"])).as_deref(), Some("ds/x\u{1f}"));
        assert_eq!(unescape_xml("a&lt;b&gt;&quot;&apos;&amp;&bogus;&"), "a<b>\"'&&bogus;&");
        let msg = unreadable_reply("http://e", "s3://evil/ds/", &page(&["ds/a&#0;b"]));
        assert!(msg.contains("the key ds/a\\u{0}b which has a character"), "{msg}");
        assert!(unreadable_reply("http://e", "s3://evil/ds/", b"<html>").contains("could not be read as S3's"));
    }
}
