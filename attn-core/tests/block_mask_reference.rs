//! The reference under a block mask equals a brute-force computation over the expanded
//! boolean mask (block tiles ANDed with key padding and packing, one softmax per row):
//! outputs, LSEs (`-inf` where a row keeps no key) and all three gradients.

use attn_core::reference::{dilated_backward_masked, dilated_forward_masked};
use attn_core::{
    AttnShape, BlockDims, BlockMaskBuf, DilatedConfig, KeyPadding, Masks, PackedSequences, SeededRng, Shape4,
};
use attn_testkit::random_vec;

/// One case: shapes, block size and the mask's broadcast sizes, padding, packing.
struct Case {
    shape: AttnShape,
    block_size: usize,
    mask_batch: usize,
    mask_heads: usize,
    cu: Option<Vec<usize>>,
    padded: bool,
}

/// The brute-force result: out, lse, dq, dk, dv.
struct Brute {
    out: Vec<f64>,
    lse: Vec<f64>,
    grads: [Vec<f64>; 3],
}

/// Dense attention with the boolean mask `allowed(b, h, i, j)` expanded per element.
fn brute(
    shape: AttnShape,
    allowed: &dyn Fn(usize, usize, usize, usize) -> bool,
    [q, k, v]: [&[f64]; 3],
    g: &[f64],
) -> Brute {
    let (qs, kvs, d) = (shape.q, shape.kv, shape.q.head_dim);
    let scale = 1.0 / (d as f64).sqrt();
    let group = qs.heads / kvs.heads;
    let qa = |b: usize, i: usize, h: usize| ((b * qs.seq + i) * qs.heads + h) * d;
    let ka = |b: usize, j: usize, h: usize| ((b * kvs.seq + j) * kvs.heads + h / group) * d;
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let mut r = Brute {
        out: vec![0.0; qs.numel()],
        lse: vec![f64::NEG_INFINITY; qs.lse_len()],
        grads: [vec![0.0; qs.numel()], vec![0.0; kvs.numel()], vec![0.0; kvs.numel()]],
    };
    for b in 0..qs.batch {
        for h in 0..qs.heads {
            for i in 0..qs.seq {
                let keys: Vec<usize> = (0..kvs.seq).filter(|&j| allowed(b, h, i, j)).collect();
                if keys.is_empty() {
                    continue;
                }
                let qi = &q[qa(b, i, h)..][..d];
                let s: Vec<f64> = keys.iter().map(|&j| scale * dot(qi, &k[ka(b, j, h)..][..d])).collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                r.lse[(b * qs.seq + i) * qs.heads + h] = lse;
                let p: Vec<f64> = s.iter().map(|x| (x - lse).exp()).collect();
                let gi = &g[qa(b, i, h)..][..d];
                let dp: Vec<f64> = keys.iter().map(|&j| dot(gi, &v[ka(b, j, h)..][..d])).collect();
                let big_d: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (t, &j) in keys.iter().enumerate() {
                    let ds = p[t] * (dp[t] - big_d);
                    for e in 0..d {
                        r.out[qa(b, i, h) + e] += p[t] * v[ka(b, j, h) + e];
                        r.grads[0][qa(b, i, h) + e] += scale * ds * k[ka(b, j, h) + e];
                        r.grads[1][ka(b, j, h) + e] += scale * ds * q[qa(b, i, h) + e];
                        r.grads[2][ka(b, j, h) + e] += p[t] * g[qa(b, i, h) + e];
                    }
                }
            }
        }
    }
    r
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() })
        .fold(0.0, |m: f64, x| if x.is_nan() { f64::INFINITY } else { m.max(x) })
}

fn cases() -> Vec<Case> {
    let s4 = |b, s, h, d| Shape4::new(b, s, h, d).unwrap();
    let self_attn = |b, s, h| AttnShape::self_attn(s4(b, s, h, 4));
    let mut cases = Vec::new();
    for block_size in [1, 3, 4, 5, 13, 16] {
        for (mask_batch, mask_heads) in [(1, 1), (2, 1), (1, 3), (2, 3)] {
            for padded in [false, true] {
                let shape = self_attn(2, 13, 3);
                cases.push(Case { shape, block_size, mask_batch, mask_heads, cu: None, padded });
            }
        }
        // Grouped key/value heads and cross-attention with its own key length.
        let grouped = AttnShape { q: s4(2, 13, 4, 4), kv: s4(2, 13, 2, 4) };
        cases.push(Case { shape: grouped, block_size, mask_batch: 2, mask_heads: 4, cu: None, padded: false });
        let cross = AttnShape { q: s4(2, 11, 2, 4), kv: s4(2, 7, 2, 4) };
        cases.push(Case { shape: cross, block_size, mask_batch: 2, mask_heads: 2, cu: None, padded: true });
        // Packed sequences: each uses the top-left square of the mask, from its own start.
        let cu = Some(vec![0, 5, 6, 14]);
        cases.push(Case { shape: self_attn(1, 14, 2), block_size, mask_batch: 1, mask_heads: 2, cu, padded: true });
    }
    cases
}

#[test]
fn the_reference_under_a_block_mask_equals_the_expanded_mask() {
    let (mut checked, mut empty_rows, mut removed) = (0, 0, 0);
    for (n, c) in cases().iter().enumerate() {
        let (qs, kvs) = (c.shape.q, c.shape.kv);
        let longest = c.cu.as_ref().map_or(0, |cu| cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0));
        let (qn, kn) = if c.cu.is_some() { (longest, longest) } else { (qs.seq, kvs.seq) };
        let dims = BlockDims {
            batch: c.mask_batch,
            heads: c.mask_heads,
            q_blocks: qn.div_ceil(c.block_size),
            k_blocks: kn.div_ceil(c.block_size),
        };
        let mut rng = SeededRng::new(1000 + n as u64);
        let block = BlockMaskBuf::from_fn(dims, c.block_size, |_, _, _, _| rng.uniform() < 0.6).unwrap();
        let mut rng = SeededRng::new(2000 + n as u64);
        let flags: Vec<bool> = (0..kvs.batch * kvs.seq).map(|_| c.padded && rng.uniform() < 0.25).collect();
        let masks = Masks {
            key_padding: c.padded.then(|| KeyPadding::new(&flags, kvs.batch, kvs.seq).unwrap()),
            packing: c.cu.as_deref().map(|cu| PackedSequences::new(cu).unwrap()),
            block: Some(block.view()),
        };
        // The expanded mask, element by element: tile kept, key not padding, and with
        // packing both positions in one sequence, counted from its start.
        let m = block.view();
        let allowed = |b: usize, h: usize, i: usize, j: usize| {
            let (bb, hh) = (if c.mask_batch == 1 { 0 } else { b }, if c.mask_heads == 1 { 0 } else { h });
            let (ri, rj) = match &c.cu {
                None => (i, j),
                Some(cu) => {
                    let s = cu.partition_point(|&x| x <= i) - 1;
                    if !(cu[s]..cu[s + 1]).contains(&j) {
                        return false;
                    }
                    (i - cu[s], j - cu[s])
                }
            };
            let (qb, kb) = (ri / c.block_size, rj / c.block_size);
            let tile = m.keep()[((bb * dims.heads + hh) * dims.q_blocks + qb) * dims.k_blocks + kb] == 1;
            // Padding is indexed by global key position, the tile by in-sequence position.
            tile && !flags[b * kvs.seq + j]
        };
        let q: Vec<f64> = random_vec(3000 + n as u64, qs.numel()).iter().map(|&x| f64::from(x)).collect();
        let k: Vec<f64> = random_vec(4000 + n as u64, kvs.numel()).iter().map(|&x| f64::from(x)).collect();
        let v: Vec<f64> = random_vec(5000 + n as u64, kvs.numel()).iter().map(|&x| f64::from(x)).collect();
        let g: Vec<f64> = random_vec(6000 + n as u64, qs.numel()).iter().map(|&x| f64::from(x)).collect();
        let want = brute(c.shape, &allowed, [&q, &k, &v], &g);
        // One pattern over the whole key length at rate 1 is dense attention.
        let cfg = DilatedConfig::new(&[kvs.seq.max(qs.seq)], &[1]).unwrap();
        let fwd = dilated_forward_masked(&cfg, c.shape, masks, [&q, &k, &v]).unwrap();
        let (_, grads, _) = dilated_backward_masked(&cfg, c.shape, masks, [&q, &k, &v], &g).unwrap();
        let what = format!("case {n}: block_size {}, shape {:?}", c.block_size, c.shape);
        assert!(max_diff(&fwd.out, &want.out) < 1e-12, "{what}: out");
        assert!(max_diff(&fwd.lse, &want.lse) < 1e-12, "{what}: lse");
        for (name, (got, w)) in ["dq", "dk", "dv"].iter().zip([&grads.dq, &grads.dk, &grads.dv].iter().zip(&want.grads))
        {
            assert!(max_diff(got, w) < 1e-12, "{what}: {name}");
        }
        empty_rows += want.lse.iter().filter(|l| **l == f64::NEG_INFINITY).count();
        removed += m.keep().iter().filter(|&&x| x == 0).count();
        checked += 1;
    }
    assert_eq!(checked, 6 * (4 * 2 + 3));
    assert!(empty_rows > 0 && removed > 0, "the cases must remove tiles and empty some rows");
}
