//! The relative L2 error of a tensor whose rows are split over ranks (the MPI ring test):
//! each rank's squared sums of its own rows, refused when its rows and the reference's
//! differ in length or are empty, and the global error from every rank's sums, refused
//! when any rank's part was. A rank's part travels as [`PART_BYTES`] bytes so that every
//! rank takes part in the exchange even when its own rows were refused.

use attn_core::Element;

/// The bytes of one rank's part: a status byte (1: sums follow, 0: refused) and two f64.
pub const PART_BYTES: usize = 17;

/// One rank's share of a global relative L2 error: `sum (got - want)^2` and `sum want^2`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ErrorSums {
    pub err2: f64,
    pub want2: f64,
}

/// The squared sums of `got` against `want` for the tensor `tensor`. Equal infinities (a
/// row with no key's `-inf` LSE) add nothing; any other non-finite value makes the error
/// infinite. A length mismatch or no rows at all is an error naming the tensor.
pub fn error_sums<A: Element, B: Element>(tensor: &str, got: &[A], want: &[B]) -> Result<ErrorSums, String> {
    if got.len() != want.len() {
        return Err(format!("{tensor}: {} values, the reference has {}", got.len(), want.len()));
    }
    if got.is_empty() {
        return Err(format!("{tensor}: no values to judge"));
    }
    let mut sums = ErrorSums { err2: 0.0, want2: 0.0 };
    for (g, w) in got.iter().zip(want) {
        let (g, w) = (g.to_f64(), w.to_f64());
        if g == w && g.is_infinite() {
            continue;
        }
        sums.err2 += if g.is_finite() && w.is_finite() { (g - w) * (g - w) } else { f64::INFINITY };
        sums.want2 += w * w;
    }
    Ok(sums)
}

/// The [`PART_BYTES`] a rank sends for its part (refused parts carry no sums).
pub fn encode(part: &Result<ErrorSums, String>) -> Vec<u8> {
    let mut out = vec![0u8; PART_BYTES];
    if let Ok(s) = part {
        out[0] = 1;
        out[1..9].copy_from_slice(&s.err2.to_le_bytes());
        out[9..17].copy_from_slice(&s.want2.to_le_bytes());
    }
    out
}

/// The global relative L2 error of `tensor` from every rank's encoded part (rank order):
/// `sqrt(sum err2 / sum want2)`, the absolute norm where the reference is all zero. A
/// rank whose part was refused or is malformed, or no ranks at all, is an error naming
/// the tensor and the ranks.
pub fn combine(tensor: &str, parts: &[Vec<u8>]) -> Result<f64, String> {
    if parts.is_empty() {
        return Err(format!("{tensor}: no rank reported"));
    }
    let (mut err2, mut want2) = (0.0, 0.0);
    let mut refused = Vec::new();
    for (rank, p) in parts.iter().enumerate() {
        match p.as_slice() {
            [1, rest @ ..] if rest.len() == 16 => {
                let f = |b: &[u8]| f64::from_le_bytes(b.try_into().unwrap_or([0xff; 8]));
                err2 += f(&rest[..8]);
                want2 += f(&rest[8..]);
            }
            _ => refused.push(rank),
        }
    }
    if !refused.is_empty() {
        return Err(format!("{tensor}: ranks {refused:?} had no comparable rows (empty, or a length mismatch)"));
    }
    let err = if want2 == 0.0 { err2.sqrt() } else { (err2 / want2).sqrt() };
    Ok(if err.is_nan() { f64::INFINITY } else { err })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank parts of `want` split in `ranks` pieces, `got` equal to `want` except where
    /// `plant` changes it.
    fn parts(want: &[f32], ranks: usize, plant: impl Fn(&mut Vec<f32>)) -> Vec<Vec<u8>> {
        let mut got = want.to_vec();
        plant(&mut got);
        let n = want.len() / ranks;
        (0..ranks).map(|r| encode(&error_sums("out", &got[r * n..(r + 1) * n], &want[r * n..(r + 1) * n]))).collect()
    }

    #[test]
    fn split_sums_give_the_whole_tensors_error() {
        let want: Vec<f32> = (0..4000).map(|i| (i as f32 * 0.37).sin()).collect();
        let exact = combine("out", &parts(&want, 4, |_| {})).unwrap();
        assert_eq!(exact, 0.0);
        let plant = |g: &mut Vec<f32>| g[3999] += 0.5;
        let split = combine("out", &parts(&want, 4, plant)).unwrap();
        let mut got = want.clone();
        plant(&mut got);
        let whole = crate::rel_l2_error(&got, &want);
        assert!((split - whole).abs() <= 1e-12 * whole, "{split} vs {whole}");
    }

    /// A value planted on the last rank is rejected by the MPI test's bound (the golden
    /// files' 1e-5) however many exact rows the other ranks hold.
    #[test]
    fn a_planted_error_on_one_rank_exceeds_the_bound() {
        let want: Vec<f32> = (0..4096).map(|i| (i as f32 * 0.11).cos()).collect();
        let err = combine("dq", &parts(&want, 4, |g| g[4000] += 0.01)).unwrap();
        assert!(err > 1e-5, "{err}");
        let nan = combine("dq", &parts(&want, 4, |g| g[10] = f32::NAN)).unwrap();
        assert_eq!(nan, f64::INFINITY);
        // A -inf LSE on both sides is agreement; on one side it is not.
        let lse = [f32::NEG_INFINITY, 1.0];
        assert_eq!(combine("lse", &[encode(&error_sums("lse", &lse, &lse))]).unwrap(), 0.0);
        let off = encode(&error_sums("lse", &[0.0f32, 1.0], &lse));
        assert_eq!(combine("lse", &[off]).unwrap(), f64::INFINITY);
    }

    #[test]
    fn a_length_mismatch_or_empty_rows_are_refused_on_every_rank() {
        let e = error_sums("dk", &[1.0f32], &[1.0f32, 2.0]).unwrap_err();
        assert!(e.contains("dk") && e.contains("1 values") && e.contains('2'), "{e}");
        let e = error_sums::<f32, f32>("out", &[], &[]).unwrap_err();
        assert!(e.contains("out") && e.contains("no values"), "{e}");
        // Rank 1 returned no rows: the combined error is refused, naming it.
        let good = encode(&error_sums("out", &[1.0f32], &[1.0f32]));
        let empty = encode(&error_sums::<f32, f32>("out", &[], &[]));
        let e = combine("out", &[good.clone(), empty, good]).unwrap_err();
        assert!(e.contains("out") && e.contains("[1]"), "{e}");
        assert!(combine("out", &[]).is_err());
        assert!(combine("out", &[vec![1, 0, 0]]).is_err());
    }
}
