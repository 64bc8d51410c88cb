//! Sizes as people write and read them: "16M" on command lines, in `#ODFS` directives and in
//! layout texts; "1.5 GiB" and "1.5G" in reports, `odfs status` and `odfs df -h`. Powers of
//! 1024 throughout, as lfs and df use them.

/// "100", "64K", "16M", "2G" → bytes (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 1 << 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 1 << 30),
        Some('t' | 'T') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a size (e.g. 512K, 16M, 1G)"))?;
    n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too large"))
}

/// `b` in the largest power of 1024 that keeps it at least 1 (up to 1024^5): (value, power).
pub fn scale_1024(b: u64) -> (f64, usize) {
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < 5 {
        v /= 1024.0;
        i += 1;
    }
    (v, i)
}

/// Bytes for reports: "512 B", "1.5 GiB".
pub fn bytes(b: u64) -> String {
    const U: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    match scale_1024(b) {
        (_, 0) => format!("{b} B"),
        (v, i) => format!("{v:.1} {}", U[i]),
    }
}

/// Bytes in a column, as `df -h` prints them: "512", "1.5G", "20G".
pub fn bytes_short(b: u64) -> String {
    const U: [&str; 6] = ["", "K", "M", "G", "T", "P"];
    match scale_1024(b) {
        (_, 0) => format!("{b}"),
        (v, i) if v < 10.0 => format!("{v:.1}{}", U[i]),
        (v, i) => format!("{v:.0}{}", U[i]),
    }
}

/// A transfer rate in MiB/s: `bytes` moved in `secs` seconds.
pub fn mib_per_sec(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64 / secs.max(1e-6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("16M"), Ok(16 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert!(parse_size("ten").unwrap_err().contains("not a size"));
        assert!(parse_size("99999999999T").unwrap_err().contains("too large"));
    }

    #[test]
    fn sizes_print() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(3 << 29), "1.5 GiB");
        assert_eq!(bytes_short(512), "512");
        assert_eq!(bytes_short(3 << 29), "1.5G");
        assert_eq!(bytes_short(20 << 30), "20G");
        assert_eq!(mib_per_sec(10 << 20, 2.0), 5.0);
    }
}
