//! Digests computed while bytes stream past: MD5 (S3 ETags, Content-MD5) and CRC32C (S3
//! additional checksums), with the byte count.

use md5::{Digest, Md5};
use odfs_proto::crc::Crc32c;

pub struct Digests {
    /// None for a CRC-only digest (a range of a split file: an MD5 of a range checks nothing).
    md5: Option<Md5>,
    crc: Crc32c,
    pub bytes: u64,
}

impl Default for Digests {
    fn default() -> Self {
        Digests { md5: Some(Md5::new()), crc: Crc32c::default(), bytes: 0 }
    }
}

impl Digests {
    /// CRC32C and byte count only: MD5 costs several times CRC32C's CPU per byte.
    pub fn crc_only() -> Self {
        Digests { md5: None, crc: Crc32c::default(), bytes: 0 }
    }

    pub fn update(&mut self, data: &[u8]) {
        if let Some(m) = &mut self.md5 {
            m.update(data);
        }
        self.crc.update(data);
        self.bytes += data.len() as u64;
    }

    pub fn has_md5(&self) -> bool {
        self.md5.is_some()
    }

    pub fn crc(&self) -> u32 {
        self.crc.value()
    }

    /// MD5 and CRC32C; a CRC-only digest has no MD5 to give (zeros): use [`Self::crc`].
    pub fn finish(self) -> ([u8; 16], u32) {
        (self.md5.map(|m| m.finalize().into()).unwrap_or_default(), self.crc.value())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        let mut d = Digests::default();
        d.update(b"1234");
        d.update(b"56789");
        let (md5, crc) = d.finish();
        assert_eq!(hex::encode(md5), "25f9e794323b453885f5181f1b624d0b");
        assert_eq!(crc, 0xe306_9283, "CRC32C check value of \"123456789\"");
    }
}
