//! Segments much longer than the kernel's per-call key slice: the all-gather and
//! direct paths split keys into slices (bounded kernel scratch) and decode received
//! rows slice by slice; the result must still equal the single-device backend.

use attn_core::error::TensorName;
use attn_core::{DType, DilatedConfig, Mixing, Shape4, TensorView};
use attn_kernels::CpuBackend;
use attn_ring::{Layout, Strategy, run_in_process};
use attn_testkit::random_vec;
use attn_testkit::tolerance::{Tolerance, rel_l2_error};

#[test]
fn long_segments_match_the_single_device_backend() {
    let shape = Shape4::new(1, 1100, 2, 8).unwrap();
    let (q, k, v) = (random_vec(21, shape.numel()), random_vec(22, shape.numel()), random_vec(23, shape.numel()));
    let view = |x| TensorView::contiguous(TensorName::Query, x, shape).unwrap();
    let tol = Tolerance::for_dtype(DType::F32);
    for mixing in [Mixing::LongNet, Mixing::HeadGroups] {
        for causal in [false, true] {
            let cfg = DilatedConfig::builder()
                .segments(&[300, 1100])
                .dilations(&[1, 2])
                .mixing(mixing)
                .causality(causal.into())
                .build()
                .unwrap();
            let (want, want_lse) = CpuBackend::new(1).unwrap().forward_vec(&cfg, shape, &q, &k, &v).unwrap();
            for world in [1, 2, 3] {
                for strategy in [Strategy::Auto, Strategy::AllGather, Strategy::Ring] {
                    for layout in [Layout::Contiguous, Layout::Zigzag] {
                        let got = run_in_process(world, &cfg, layout, strategy, view(&q), view(&k), view(&v)).unwrap();
                        let (e, el) = (rel_l2_error(&got.out, &want), rel_l2_error(&got.lse, &want_lse));
                        assert!(
                            tol.accepts(e) && tol.accepts(el),
                            "{mixing:?} causal={causal} p={world} {strategy:?} {layout:?}: {e:e} {el:e}"
                        );
                    }
                }
            }
        }
    }
}
