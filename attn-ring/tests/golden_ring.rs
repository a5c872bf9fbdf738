//! Every golden file in `conformance/dilated`, `conformance/features` and the
//! self-attention files of `conformance/wide` through the ring: every strategy x layout x
//! world size 1..=8, forward (out, lse) and gradients; the cross-attention files of `wide`
//! refused with a typed error.

use crate::common;

use attn_core::{AttnError, Feature};
use attn_ring::{Layout, Strategy};
use attn_testkit::golden::{DilatedBackend, GoldenCase, Problem, golden_dir, load_dir};
use common::{RingBackend, golden_sweep, golden_sweep_cases};

#[test]
fn ring_matches_every_golden_file() {
    let runs = golden_sweep("dilated", 1..=8, |world, layout, strategy| RingBackend { world, layout, strategy });
    assert_eq!(runs.len(), 9 * 8 * 2 * 3);
}

#[test]
fn ring_matches_every_feature_golden_file() {
    let runs = golden_sweep("features", 1..=8, |world, layout, strategy| RingBackend { world, layout, strategy });
    assert_eq!(runs.len(), 9 * 8 * 2 * 3);
}

/// `conformance/wide`: the self-attention files (head_dim 64 and 128, an explicit scale)
/// through the ring at every world size, layout and strategy; the cross-attention files
/// (keys of their own length) are refused with the ring's typed `Unsupported`, forward and
/// backward, at every world size, layout and strategy.
#[test]
fn ring_matches_the_wide_self_attention_files_and_refuses_the_cross_files() {
    let dir = golden_dir().join("wide");
    let cases: Vec<GoldenCase> = load_dir(&dir).unwrap().into_iter().map(|(_, c)| c.unwrap()).collect();
    assert_eq!(cases.len(), 5, "the wide files in {}", dir.display());
    let (cross, own): (Vec<_>, Vec<_>) = cases.into_iter().partition(|c| {
        let s = c.attn_shape().unwrap();
        s.kv.seq != s.q.seq
    });
    assert_eq!((cross.len(), own.len()), (2, 3));
    let runs = golden_sweep_cases(own, 1..=8, |world, layout, strategy| RingBackend { world, layout, strategy });
    assert_eq!(runs.len(), 3 * 8 * 2 * 3);
    let mut refusals = 0;
    for case in &cross {
        let (cfg, shape) = (case.config().unwrap(), case.attn_shape().unwrap());
        let problem = Problem::new(&cfg, shape);
        let [q, k, v, go] = ["q", "k", "v", "grad_out"].map(|t| case.tensor(t).unwrap().data.as_slice());
        for world in 1..=8 {
            for layout in [Layout::Contiguous, Layout::Zigzag] {
                if layout.check(shape.q.seq, world).is_err() {
                    continue;
                }
                for strategy in [Strategy::Auto, Strategy::Ring, Strategy::AllGather] {
                    let ring = RingBackend { world, layout, strategy };
                    let refused = |r: Result<(), AttnError>| {
                        matches!(r, Err(AttnError::Unsupported { backend: "ring", feature: Feature::CrossAttention }))
                    };
                    assert!(refused(ring.forward(&problem, [q, k, v]).map(|_| ())), "{} {}", case.name, ring.name());
                    assert!(refused(ring.backward(&problem, [q, k, v], go).map(|_| ())), "{}", case.name);
                    refusals += 1;
                }
            }
        }
    }
    assert_eq!(refusals, 2 * 8 * 2 * 3);
}
