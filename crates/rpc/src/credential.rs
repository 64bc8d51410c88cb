//! Site key and per-job credential.
//!
//! The site key is a root-only file of 32 random bytes (hex) that every node of a site holds,
//! like munge's key. A job's credential is derived from it and the job id with HKDF-SHA256, so
//! every node computes the same credential and no secret travels between nodes. It yields:
//! an Ed25519 key and a self-signed certificate that every daemon and client presents in TLS
//! (peers accept exactly this certificate and nothing else), a key for authenticating TCP bulk
//! streams, and the QUIC stateless-reset key (so a restarted daemon can reset stale connections).

use crate::RpcError;
use hkdf::Hkdf;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use sha2::Sha256;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Bytes of a site key.
pub const SITE_KEY_LEN: usize = 32;

/// The site secret.
#[derive(Clone)]
pub struct SiteKey([u8; SITE_KEY_LEN]);

impl std::fmt::Debug for SiteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SiteKey(..)")
    }
}

impl SiteKey {
    pub fn generate() -> SiteKey {
        let mut k = [0u8; SITE_KEY_LEN];
        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut k);
        SiteKey(k)
    }

    pub fn from_bytes(b: [u8; SITE_KEY_LEN]) -> SiteKey {
        SiteKey(b)
    }

    /// Writes a new key file readable by its owner only; refuses to overwrite one.
    pub fn write_new(&self, path: &Path) -> Result<(), RpcError> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| RpcError::Credential(format!("cannot create site key {}: {e}", path.display())))?;
        writeln!(f, "{}", hex::encode(self.0))
            .and_then(|_| f.sync_all())
            .map_err(|e| RpcError::Credential(format!("cannot write site key {}: {e}", path.display())))
    }

    /// Loads a key file. The file must not be readable or writable by group or others.
    pub fn load(path: &Path) -> Result<SiteKey, RpcError> {
        let meta = fs::metadata(path)
            .map_err(|e| RpcError::Credential(format!("cannot read site key {}: {e}", path.display())))?;
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(RpcError::Credential(format!(
                "site key {} has mode {:o}; it must be readable by its owner only (chmod 600)",
                path.display(),
                meta.permissions().mode() & 0o777
            )));
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        if meta.uid() != me && meta.uid() != 0 {
            return Err(RpcError::Credential(format!(
                "site key {} is owned by uid {}; it must be owned by root or by uid {me}",
                path.display(),
                meta.uid()
            )));
        }
        let text = fs::read_to_string(path)
            .map_err(|e| RpcError::Credential(format!("cannot read site key {}: {e}", path.display())))?;
        let bytes = hex::decode(text.trim())
            .map_err(|_| RpcError::Credential(format!("site key {} is not hex", path.display())))?;
        let arr: [u8; SITE_KEY_LEN] = bytes
            .try_into()
            .map_err(|_| RpcError::Credential(format!("site key {} must hold {SITE_KEY_LEN} bytes", path.display())))?;
        Ok(SiteKey(arr))
    }
}

/// Everything a job's processes need to prove they belong to the job.
#[derive(Clone)]
pub struct JobCredential {
    pub job_id: String,
    cert: CertificateDer<'static>,
    key_pkcs8: Vec<u8>,
    bulk_key: [u8; 32],
    reset_key: [u8; 32],
}

impl std::fmt::Debug for JobCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JobCredential({})", self.job_id)
    }
}

/// PKCS#8 v1 prefix of an Ed25519 private key; the 32-byte seed follows.
const ED25519_PKCS8_PREFIX: [u8; 16] =
    [0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];

impl JobCredential {
    /// Derives the job's credential. Deterministic: the same site key and job id give the same
    /// certificate on every node.
    pub fn derive(site: &SiteKey, job_id: &str) -> Result<JobCredential, RpcError> {
        if job_id.is_empty() {
            return Err(RpcError::Credential("job id is empty".into()));
        }
        let hk = Hkdf::<Sha256>::new(Some(b"odfs-job-credential-v1"), &site.0);
        let mut okm = [0u8; 96];
        hk.expand(job_id.as_bytes(), &mut okm).map_err(|_| RpcError::Credential("key derivation failed".into()))?;
        let mut key_pkcs8 = ED25519_PKCS8_PREFIX.to_vec();
        key_pkcs8.extend_from_slice(&okm[..32]);
        let mut bulk_key = [0u8; 32];
        bulk_key.copy_from_slice(&okm[32..64]);
        let mut reset_key = [0u8; 32];
        reset_key.copy_from_slice(&okm[64..96]);

        let der = PrivatePkcs8KeyDer::from(key_pkcs8.clone());
        let kp = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&der, &rcgen::PKCS_ED25519)
            .map_err(|e| RpcError::Credential(format!("job key: {e}")))?;
        let mut params = rcgen::CertificateParams::new(vec!["odfs".to_string()])
            .map_err(|e| RpcError::Credential(format!("certificate parameters: {e}")))?;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(rcgen::DnType::CommonName, format!("odfs job {job_id}"));
        // Fixed validity and serial keep the certificate identical on every node.
        params.not_before = rcgen::date_time_ymd(2000, 1, 1);
        params.not_after = rcgen::date_time_ymd(4000, 1, 1);
        params.serial_number = Some(rcgen::SerialNumber::from_slice(&[1]));
        let cert = params.self_signed(&kp).map_err(|e| RpcError::Credential(format!("certificate: {e}")))?;
        Ok(JobCredential { job_id: job_id.to_string(), cert: cert.der().clone(), key_pkcs8, bulk_key, reset_key })
    }

    pub fn cert(&self) -> &CertificateDer<'static> {
        &self.cert
    }

    pub fn private_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_pkcs8.clone()))
    }

    pub fn bulk_key(&self) -> &[u8; 32] {
        &self.bulk_key
    }

    pub fn reset_key(&self) -> &[u8; 32] {
        &self.reset_key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derivation_is_deterministic_and_job_specific() {
        let site = SiteKey::from_bytes([7; 32]);
        let a = JobCredential::derive(&site, "42").unwrap();
        let b = JobCredential::derive(&site, "42").unwrap();
        let c = JobCredential::derive(&site, "43").unwrap();
        let other = JobCredential::derive(&SiteKey::from_bytes([8; 32]), "42").unwrap();
        assert_eq!(a.cert(), b.cert());
        assert_eq!(a.bulk_key(), b.bulk_key());
        assert_ne!(a.cert(), c.cert());
        assert_ne!(a.bulk_key(), c.bulk_key());
        assert_ne!(a.cert(), other.cert());
    }

    #[test]
    fn key_file_must_be_private() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("site.key");
        SiteKey::generate().write_new(&p).unwrap();
        assert!(SiteKey::load(&p).is_ok());
        assert!(SiteKey::generate().write_new(&p).is_err(), "must not overwrite");
        fs::set_permissions(&p, fs::Permissions::from_mode(0o644)).unwrap();
        let e = SiteKey::load(&p).unwrap_err().to_string();
        assert!(e.contains("owner only"), "{e}");
    }
}
