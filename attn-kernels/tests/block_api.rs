//! Block API: splitting keys into blocks and merging equals the f64 reference over all keys;
//! block backward summed over blocks equals the reference gradients; typed errors.

use attn_core::reference::{dilated_backward, dilated_forward};
use attn_core::{AttnError, AttnShape, Band, DilatedConfig, Mixing, SegmentPattern, Shape4};
use attn_kernels::{Block, BlockGradients, BlockRows, Upstream, attend_block, attend_block_backward};
use attn_testkit::{random_vec, rel_l2_error};

fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// One head (heads = 1) of LongNet mixing over `patterns`, run block by block.
fn band(causal: bool) -> Band {
    if causal { Band::CAUSAL } else { Band::FULL }
}

fn check_blocks(n: usize, d: usize, segs: &[usize], rates: &[usize], causal: bool, cuts: &[usize], seed: u64) {
    let cfg = DilatedConfig::builder()
        .segments(segs)
        .dilations(rates)
        .mixing(Mixing::LongNet)
        .causality(causal.into())
        .build()
        .unwrap();
    let shape = AttnShape::self_attn(Shape4::new(1, n, 1, d).unwrap());
    let (q, k, v, go) = (
        random_vec(seed, n * d),
        random_vec(seed + 1, n * d),
        random_vec(seed + 2, n * d),
        random_vec(seed + 3, n * d),
    );
    let (fwd, grads) = dilated_backward(&cfg, shape, &to64(&q), &to64(&k), &to64(&v), &to64(&go)).unwrap();
    let want = dilated_forward(&cfg, shape, &to64(&q), &to64(&k), &to64(&v)).unwrap();
    assert_eq!(fwd.out, want.out);
    let scale = cfg.scale_for(d) as f32;
    let pos: Vec<usize> = (0..n).collect();
    let hp = cfg.head_patterns(1, 0);
    let mut bounds = vec![0];
    bounds.extend(cuts.iter().copied().filter(|&c| c > 0 && c < n));
    bounds.push(n);
    let blocks: Vec<(usize, usize)> = bounds.windows(2).map(|w| (w[0], w[1])).collect();
    let mut out = vec![0.0f32; n * d];
    let mut lse = vec![f32::NEG_INFINITY; n];
    let qb = BlockRows::new(&q, d, &pos);
    // Key blocks in reverse order: merging is order independent.
    for &(lo, hi) in blocks.iter().rev() {
        let kb = BlockRows::new(&k[lo * d..], d, &pos[lo..hi]);
        let vb = BlockRows::new(&v[lo * d..], d, &pos[lo..hi]);
        for (_, p) in &hp.patterns {
            attend_block(&Block::new(p, band(causal), scale, d, [qb, kb, vb]), &mut out, &mut lse).unwrap();
        }
    }
    let err = rel_l2_error(&out, &fwd.out);
    assert!(err < 1e-5, "out err {err}");
    for (a, b) in lse.iter().zip(&fwd.lse) {
        assert!((*a as f64 - b).abs() < 1e-4 || (*a as f64 == *b && b.is_infinite()), "{a} vs {b}");
    }
    // Backward: query blocks x key blocks, accumulating.
    let delta: Vec<f32> = (0..n).map(|i| (0..d).map(|e| go[i * d + e] * out[i * d + e]).sum()).collect();
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; n * d], vec![0.0f32; n * d], vec![0.0f32; n * d]);
    for &(qlo, qhi) in &blocks {
        let qb = BlockRows::new(&q[qlo * d..], d, &pos[qlo..qhi]);
        for &(lo, hi) in &blocks {
            let kb = BlockRows::new(&k[lo * d..], d, &pos[lo..hi]);
            let vb = BlockRows::new(&v[lo * d..], d, &pos[lo..hi]);
            let mut dqb = vec![0.0f32; (qhi - qlo) * d];
            let (mut dkb, mut dvb) = (vec![0.0f32; (hi - lo) * d], vec![0.0f32; (hi - lo) * d]);
            for (_, p) in &hp.patterns {
                attend_block_backward(
                    &Block::new(p, band(causal), scale, d, [qb, kb, vb]),
                    &Upstream {
                        grad_out: BlockRows::new(&go[qlo * d..qhi * d], d, &pos[qlo..qhi]),
                        grad_scale: 1.0,
                        lse: &lse[qlo..qhi],
                        delta: &delta[qlo..qhi],
                    },
                    BlockGradients { dq: &mut dqb, dk: &mut dkb, dv: &mut dvb },
                )
                .unwrap();
            }
            dq[qlo * d..qhi * d].iter_mut().zip(&dqb).for_each(|(a, b)| *a += b);
            dk[lo * d..hi * d].iter_mut().zip(&dkb).for_each(|(a, b)| *a += b);
            dv[lo * d..hi * d].iter_mut().zip(&dvb).for_each(|(a, b)| *a += b);
        }
    }
    for (name, got, want) in [("dq", &dq, &grads.dq), ("dk", &dk, &grads.dk), ("dv", &dv, &grads.dv)] {
        let err = rel_l2_error(got, want);
        assert!(err < 2e-5, "{name} err {err}");
    }
}

#[test]
fn key_blocks_merge_to_the_whole() {
    check_blocks(37, 8, &[8, 16], &[1, 2], false, &[5, 20, 21], 1);
    check_blocks(37, 8, &[8, 16], &[1, 2], true, &[5, 20, 21], 2);
    check_blocks(150, 16, &[32, 64, 128], &[1, 2, 4], true, &[64, 100], 3);
    check_blocks(150, 24, &[32, 64, 128], &[1, 2, 4], false, &[1, 149], 4);
    check_blocks(300, 64, &[256], &[1], true, &[130], 5);
    check_blocks(300, 64, &[100, 300], &[3, 5], false, &[], 6);
}

#[test]
fn bad_block_inputs_are_typed_errors() {
    let p = SegmentPattern::new(4, 1, 0);
    let data = vec![0.0f32; 16];
    let pos = [0usize, 1, 2, 3];
    let ok = BlockRows::new(&data, 4, &pos);
    let short = BlockRows::new(&data[..10], 4, &pos);
    let (mut out, mut lse) = (vec![0.0f32; 16], vec![f32::NEG_INFINITY; 4]);
    assert!(matches!(
        attend_block(&Block::new(&p, Band::FULL, 0.5, 4, [short, ok, ok]), &mut out, &mut lse),
        Err(AttnError::BufferTooSmall { .. })
    ));
    assert!(matches!(
        attend_block(&Block::new(&p, Band::FULL, f32::NAN, 4, [ok, ok, ok]), &mut out, &mut lse),
        Err(AttnError::InvalidScale(_))
    ));
    assert!(matches!(
        attend_block(&Block::new(&p, Band::FULL, 0.5, 4, [ok, ok, ok]), &mut out[..15], &mut lse),
        Err(AttnError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        attend_block(&Block::new(&p, Band::FULL, 0.5, 0, [ok, ok, ok]), &mut out, &mut lse),
        Err(AttnError::ZeroDim { .. })
    ));
    let overlapping = BlockRows::new(&data, 2, &pos);
    assert!(attend_block(&Block::new(&p, Band::FULL, 0.5, 4, [overlapping, ok, ok]), &mut out, &mut lse).is_err());
    let bad = SegmentPattern { w: 0, r: 1, off: 0 };
    assert!(attend_block(&Block::new(&bad, Band::FULL, 0.5, 4, [ok, ok, ok]), &mut out, &mut lse).is_err());
    // Empty blocks are fine and change nothing.
    let empty = BlockRows::new(&data[..0], 4, &[]);
    attend_block(&Block::new(&p, Band::FULL, 0.5, 4, [ok, empty, empty]), &mut out, &mut lse).unwrap();
    assert!(lse.iter().all(|l| *l == f32::NEG_INFINITY) && out.iter().all(|o| *o == 0.0));
}

/// grad_out read in place (strided, any stride) with its scale gives bit for bit the
/// gradients of the pre-scaled contiguous copy; bad grad_out inputs are typed errors.
#[test]
fn backward_reads_grad_out_in_place_with_its_scale() {
    let (n, d, s) = (40, 16, 0.37f32);
    let p = SegmentPattern::new(16, 2, 1);
    let pos: Vec<usize> = (0..n).collect();
    let (q, k, v) = (random_vec(1, n * d), random_vec(2, n * d), random_vec(3, n * d));
    // grad_out interleaved with junk: row i at 2*d*i.
    let wide = random_vec(4, n * 2 * d);
    let eff: Vec<f32> = (0..n).flat_map(|i| wide[2 * d * i..2 * d * i + d].iter().map(|x| x * s)).collect();
    let lse = random_vec(5, n);
    let delta = random_vec(6, n);
    let qb = BlockRows::new(&q, d, &pos);
    let (kb, vb) = (BlockRows::new(&k, d, &pos), BlockRows::new(&v, d, &pos));
    let run = |go: &BlockRows<'_, f32>, scale: f32| {
        let (mut dq, mut dk, mut dv) = (vec![0.0f32; n * d], vec![0.0f32; n * d], vec![0.0f32; n * d]);
        attend_block_backward(
            &Block::new(&p, Band::CAUSAL, 0.25, d, [qb, kb, vb]),
            &Upstream { grad_out: *go, grad_scale: scale, lse: &lse, delta: &delta },
            BlockGradients { dq: &mut dq, dk: &mut dk, dv: &mut dv },
        )
        .map(|()| (dq, dk, dv))
    };
    let want = run(&BlockRows::new(&eff, d, &pos), 1.0).unwrap();
    let got = run(&BlockRows::new(&wide, 2 * d, &pos), s).unwrap();
    assert!(want.0.iter().any(|x| *x != 0.0), "gradients are not all zero");
    assert_eq!(got, want);
    // A grad_out with fewer rows than q, a short buffer, or a non-finite scale.
    assert!(matches!(run(&BlockRows::new(&eff, d, &pos[..n - 1]), 1.0), Err(AttnError::ShapeMismatch { .. })));
    assert!(matches!(run(&BlockRows::new(&eff[..n * d - 1], d, &pos), 1.0), Err(AttnError::BufferTooSmall { .. })));
    assert!(matches!(run(&BlockRows::new(&eff, d, &pos), f32::NAN), Err(AttnError::InvalidScale(_))));
}
