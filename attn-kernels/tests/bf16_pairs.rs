//! The bf16 pair forward on both engines (AMX tiles, `Isa::Amx`, and AVX512-BF16 dot
//! products, `Isa::Avx512Bf16`) against the float64 reference and the AVX-512 f32 path:
//! odd head dims, ragged lengths, causal and LongNet cases; thread-count independence;
//! and the fallbacks (a non-finite piece, heads wider than 512) that hand a piece to the
//! f32 kernel. An engine this CPU lacks is skipped, with the reason printed, unless
//! `ATTN_REQUIRE_ISA` names it.

use crate::common;

use attn_core::{AttnShape, DType, DilatedConfig, Mixing, Shape4};
use attn_kernels::{CpuBackend, Isa};
use attn_testkit::judge::{Expected, judge_forward, verdict};
use attn_testkit::{random_vec, rel_l2_error};
use common::{back, conv, to64};
use half::bf16;

/// The pair engines this CPU (and OS) offers; one it lacks fails the test where
/// `ATTN_REQUIRE_ISA` names it.
fn engines(test: &str) -> Vec<Isa> {
    common::isas_here(test, [Isa::Amx, Isa::Avx512Bf16])
}

fn pairs(isa: Isa, threads: usize) -> CpuBackend {
    CpuBackend::new(threads).unwrap().with_isa(isa).unwrap()
}

fn avx512(threads: usize) -> CpuBackend {
    CpuBackend::new(threads).unwrap().with_isa(Isa::Avx512).unwrap()
}

fn inputs(shape: Shape4, seed: u64) -> [Vec<bf16>; 3] {
    let n = shape.numel();
    [conv(&random_vec(seed, n)), conv(&random_vec(seed + 1, n)), conv(&random_vec(seed + 2, n))]
}

fn bits(x: &[bf16]) -> Vec<u16> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Shapes that exercise every padding of the tile layout: head dims below, between and
/// above the 32-wide `q·k` chunks and 16-wide output tiles, query blocks and key steps
/// cut mid-way, and heads wider than the 64 columns the output keeps in tiles.
#[test]
fn pair_engines_match_reference_on_ragged_shapes() {
    for isa in engines("pair_engines_match_reference_on_ragged_shapes") {
        let be = pairs(isa, 2);
        let cases = [
            (&[64, 128][..], &[1, 2][..], Mixing::HeadGroups, false, 300, 2, 8),
            (&[100, 300][..], &[1, 3][..], Mixing::LongNet, true, 333, 2, 40),
            (&[256, 512][..], &[1, 2][..], Mixing::LongNet, false, 530, 1, 64),
            (&[200, 400, 700][..], &[1, 3, 5][..], Mixing::HeadGroups, true, 700, 4, 72),
            (&[300][..], &[1][..], Mixing::HeadGroups, false, 301, 1, 96),
            (&[160, 320][..], &[1, 2][..], Mixing::LongNet, true, 480, 2, 136),
            (&[1024][..], &[1][..], Mixing::HeadGroups, true, 1000, 1, 128),
            (&[96, 192][..], &[1, 2][..], Mixing::LongNet, true, 200, 1, 256),
            (&[128][..], &[1][..], Mixing::HeadGroups, false, 150, 1, 512),
        ];
        for (i, (w, r, mixing, causal, n, h, d)) in cases.into_iter().enumerate() {
            let cfg = DilatedConfig::builder()
                .segments(w)
                .dilations(r)
                .mixing(mixing)
                .causality(causal.into())
                .build()
                .unwrap();
            let shape = Shape4::new(1, n, h, d).unwrap();
            let [q, k, v] = inputs(shape, 40 + 3 * i as u64);
            let want = Expected::of(&cfg, AttnShape::self_attn(shape), [&q, &k, &v], None).unwrap();
            let (out, lse) = be.forward_vec(&cfg, shape, &q, &k, &v).unwrap();
            let checks = judge_forward(&want, &out, &lse, DType::BF16);
            if let Err(e) = verdict(&checks) {
                panic!("{} case {i} (d={d}): {e}", isa.as_str());
            }
            let err = checks[0].rel_l2;
            // The tile path and the f32 path differ only by the bf16 rounding of p.
            let (alt, _) = avx512(2).forward_vec(&cfg, shape, &q, &k, &v).unwrap();
            let gap = rel_l2_error(&back(&out), &to64(&back(&alt)));
            assert!(gap < 1e-2, "{} case {i}: vs avx512 rel gap {gap:.3e}", isa.as_str());
            println!("{} case {i} d={d}: vs reference {err:.2e}, vs avx512 {gap:.2e}", isa.as_str());
        }
    }
}

#[test]
fn pair_results_do_not_depend_on_the_thread_count() {
    for isa in engines("pair_results_do_not_depend_on_the_thread_count") {
        let one = pairs(isa, 1);
        let cfg = DilatedConfig::builder().segments(&[128, 512]).dilations(&[1, 2]).causal().build().unwrap();
        let shape = Shape4::new(2, 900, 4, 64).unwrap();
        let [q, k, v] = inputs(shape, 7);
        let (o1, l1) = one.forward_vec(&cfg, shape, &q, &k, &v).unwrap();
        for threads in [2, 3] {
            let (o, l) = pairs(isa, threads).forward_vec(&cfg, shape, &q, &k, &v).unwrap();
            assert_eq!(bits(&o1), bits(&o), "{}: out, {threads} threads", isa.as_str());
            assert!(
                l1.iter().zip(&l).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{}: lse, {threads} threads",
                isa.as_str()
            );
        }
    }
}

/// A NaN in one value row sends the pieces that hold it to the f32 kernel: exactly the
/// rows that read it turn non-finite; every other row stays finite and equal to the clean
/// run (bit for bit outside the poisoned pieces, within bf16 rounding inside them).
#[test]
fn a_non_finite_value_stays_in_the_rows_that_read_it() {
    for isa in engines("a_non_finite_value_stays_in_the_rows_that_read_it") {
        let be = pairs(isa, 2);
        let cfg = DilatedConfig::builder().segments(&[64, 128]).dilations(&[1, 2]).causal().build().unwrap();
        let shape = Shape4::new(1, 256, 2, 64).unwrap();
        let [q, k, mut v] = inputs(shape, 11);
        let (clean, _) = be.forward_vec(&cfg, shape, &q, &k, &v).unwrap();
        let (poisoned_pos, head, d) = (70, 0, shape.head_dim);
        v[(poisoned_pos * shape.heads + head) * d + 5] = bf16::NAN;
        let (out, _) = be.forward_vec(&cfg, shape, &q, &k, &v).unwrap();
        let hp = cfg.head_patterns(shape.heads, head);
        let (mut readers, mut same_piece, mut exact) = (0, 0, 0);
        for t in 0..shape.seq {
            for h in 0..shape.heads {
                let row = (t * shape.heads + h) * d;
                let (got, want) = (&out[row..row + d], &clean[row..row + d]);
                let in_piece = |causal| {
                    hp.patterns.iter().any(|(_, p)| p.attends(t, poisoned_pos, attn_core::Causality::from(causal)))
                };
                if h == head && in_piece(true) {
                    readers += 1;
                    assert!(got.iter().any(|x| !x.to_f32().is_finite()), "{}: row {t} reads the NaN", isa.as_str());
                } else if h == head && in_piece(false) {
                    // Same segment and pattern as the NaN (so run by the f32 kernel), but masked.
                    same_piece += 1;
                    assert!(got.iter().all(|x| x.to_f32().is_finite()), "row {t}: NaN leaked");
                    let gap = rel_l2_error(&back(got), &to64(&back(want)));
                    assert!(gap < 1e-2, "row {t}: {gap:.3e} from the clean run");
                } else {
                    exact += 1;
                    assert_eq!(bits(got), bits(want), "{}: row {t} head {h}", isa.as_str());
                }
            }
        }
        assert!(readers > 0 && same_piece > 0 && exact > readers, "{readers} / {same_piece} / {exact}");
    }
}

/// Heads wider than the tile path takes run on the f32 kernel: bit-identical to AVX-512.
#[test]
fn heads_wider_than_512_use_the_f32_kernel() {
    for isa in engines("heads_wider_than_512_use_the_f32_kernel") {
        let be = pairs(isa, 2);
        let cfg = DilatedConfig::builder().segments(&[32, 64]).dilations(&[1, 2]).build().unwrap();
        let shape = Shape4::new(1, 96, 2, 520).unwrap();
        let [q, k, v] = inputs(shape, 23);
        let (got, _) = be.forward_vec(&cfg, shape, &q, &k, &v).unwrap();
        let (want, _) = avx512(2).forward_vec(&cfg, shape, &q, &k, &v).unwrap();
        assert_eq!(bits(&got), bits(&want), "{}", isa.as_str());
    }
}
