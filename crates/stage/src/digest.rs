//! Digests computed while bytes stream past: MD5 (S3 ETags, Content-MD5) and CRC32C (S3
//! additional checksums), with the byte count.

use md5::{Digest, Md5};

pub struct Digests {
    md5: Md5,
    crc: u32,
    pub bytes: u64,
}

impl Default for Digests {
    fn default() -> Self {
        Digests { md5: Md5::new(), crc: 0, bytes: 0 }
    }
}

impl Digests {
    pub fn update(&mut self, data: &[u8]) {
        self.md5.update(data);
        self.crc = crc32c::crc32c_append(self.crc, data);
        self.bytes += data.len() as u64;
    }

    pub fn finish(self) -> ([u8; 16], u32) {
        (self.md5.finalize().into(), self.crc)
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
