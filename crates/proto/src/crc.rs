//! CRC-32C (Castagnoli), the checksum of chunk writes (`Written::crc32c`) and of S3's additional
//! checksums: computed over bytes ([`checksum`], [`Crc32c`]) and combined from the CRCs of
//! parts ([`combine`]), which lets a writer check the bytes stored wrote without reading them
//! back (each chunk write returns its CRC32C; the writer combines them).
//!
//! Computed by crc-fast, which folds 64 bytes a step with carry-less multiplies
//! (VPCLMULQDQ/PCLMULQDQ, or NEON): about 44 GB/s per core here against 16 GB/s for the
//! `crc32` instruction the crc32c crate uses; every staged byte is checksummed twice (the agent
//! over what it received, stored over what it wrote), which took 6-7% of both processes' CPU.
//!
//! The CRC of `a ++ b` is the CRC of `a` shifted by `8 * len(b)` zero bits, xored with the CRC
//! of `b`. The shift is a product with x^(8 len) modulo the polynomial, built from a table of
//! x^(2^k): one product of 32 steps per set bit of the length, 125 ns for a 1 MiB part here.
//! The crc32c crate's combine squares 32 x 32 bit matrices for every bit of the length instead
//! (81 us for 1 MiB): a stage-in combines once per chunk written, and that took 4.5% of the
//! machine's CPU while it ran (bench/history/, the staging runs of 2026-11-29).

use crc_fast::CrcAlgorithm::Crc32Iscsi;

/// CRC32C of `data`.
pub fn checksum(data: &[u8]) -> u32 {
    crc_fast::checksum(Crc32Iscsi, data) as u32
}

/// CRC32C of bytes that arrive in pieces.
#[derive(Clone)]
pub struct Crc32c(crc_fast::Digest);

impl Default for Crc32c {
    fn default() -> Self {
        Crc32c(crc_fast::Digest::new(Crc32Iscsi))
    }
}

impl Crc32c {
    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    /// CRC32C of everything given so far.
    pub fn value(&self) -> u32 {
        self.0.finalize() as u32
    }
}

/// The CRC-32C (Castagnoli) polynomial, bit-reflected as the CRC is computed.
const POLY: u32 = 0x82F6_3B78;

/// `a * b` modulo the polynomial, both in reflected order (the top bit is x^0).
const fn mul(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut bit = 0;
    while bit < 32 {
        if a & (1 << (31 - bit)) != 0 {
            product ^= b;
        }
        // b *= x
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
        bit += 1;
    }
    product
}

/// `X2N[k]` = x^(2^k) modulo the polynomial, for every bit of a 64-bit byte count (k = 3..=66).
/// (The CRC-32C polynomial is not irreducible, so the powers do not repeat with period 32.)
const X2N: [u32; 67] = {
    let mut t = [0u32; 67];
    t[0] = 1 << 30; // x^1
    let mut k = 1;
    while k < t.len() {
        t[k] = mul(t[k - 1], t[k - 1]);
        k += 1;
    }
    t
};

/// x^(8 n) modulo the polynomial: the operator that appends `n` zero bytes.
fn shift_bytes(mut n: u64) -> u32 {
    let mut p = 1 << 31; // x^0
    let mut k = 3; // a byte is 2^3 bits
    while n != 0 {
        if n & 1 != 0 {
            p = mul(X2N[k], p);
        }
        n >>= 1;
        k += 1;
    }
    p
}

/// The CRC32C of `a ++ b` given `crc_a` = CRC32C(a), `crc_b` = CRC32C(b) and `len_b` = len(b).
pub fn combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    if len_b == 0 {
        return crc_a;
    }
    mul(shift_bytes(len_b), crc_a) ^ crc_b
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checked against the crc32c crate, an implementation of its own.
    #[test]
    fn checksums_agree_with_another_implementation_whole_and_in_pieces() {
        assert_eq!(checksum(b"123456789"), 0xe306_9283, "the CRC-32C check value");
        assert_eq!(checksum(b""), 0);
        let data: Vec<u8> = (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        for len in [1, 15, 16, 63, 64, 65, 255, 4096, 65_537, 300_000] {
            let d = &data[..len];
            assert_eq!(checksum(d), crc32c::crc32c(d), "len {len}");
            let mut c = Crc32c::default();
            for piece in d.chunks(len / 3 + 1) {
                c.update(piece);
            }
            assert_eq!(c.value(), crc32c::crc32c(d), "len {len} in pieces");
        }
    }

    #[test]
    fn combines_as_the_crc_of_the_concatenation() {
        let data: Vec<u8> = (0..70_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let whole = crc32c::crc32c(&data);
        for cut in [0, 1, 2, 3, 7, 8, 255, 4096, 65_535, 69_999, 70_000] {
            let (a, b) = data.split_at(cut);
            let got = combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len() as u64);
            assert_eq!(got, whole, "cut at {cut}");
        }
    }

    #[test]
    fn agrees_with_the_crc32c_crate_for_long_lengths() {
        for (a, b, len) in [
            (0, 0, 1u64 << 20),
            (0xdead_beef, 0x1234_5678, (1 << 30) + 3),
            (1, 2, u64::MAX >> 20),
            (7, 9, 1 << 40),
            (3, 4, u64::MAX),
        ] {
            assert_eq!(combine(a, b, len), crc32c::crc32c_combine(a, b, len as usize), "len {len}");
        }
    }
}
