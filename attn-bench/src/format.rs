//! Number formats of the report: bytes as MiB, counts with thousands separators.

/// Bytes as MiB (the report's "MB").
pub fn mb(b: u64) -> f64 {
    b as f64 / 1048576.0
}

/// `n` with thousands separators.
pub fn int(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
