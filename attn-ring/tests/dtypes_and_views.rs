//! Other dtypes (f16, bf16, f64) travel exactly on the wire: the ring and the
//! single-device backend in the same dtype are both judged row by row against the float64
//! reference on those inputs, forward and backward; strided (fused QKV) views work.

use attn_core::error::TensorName;
use attn_core::{AttnShape, DType, DilatedConfig, Element, Mixing, Shape4, TensorView, TensorViewMut};
use attn_kernels::CpuBackend;
use attn_ring::{
    Layout, Strategy, ThreadComm, local_rows, problem_for, ring_forward, run_in_process, run_in_process_backward,
};
use attn_testkit::judge::judge;
use attn_testkit::random_vec;
use attn_testkit::tolerance::{Tolerance, rel_l2_error};
use half::{bf16, f16};

fn cfg() -> DilatedConfig {
    DilatedConfig::builder()
        .segments(&[6, 24, 40])
        .dilations(&[1, 2, 4])
        .mixing(Mixing::LongNet)
        .causal()
        .build()
        .unwrap()
}

fn check_dtype<T: Element>() {
    let shape = Shape4::new(2, 37, 3, 8).unwrap();
    let conv = |seed| random_vec(seed, shape.numel()).into_iter().map(T::from_f32).collect::<Vec<T>>();
    let (q, k, v) = (conv(1), conv(2), conv(3));
    let go = conv(4);
    let attn = AttnShape::self_attn(shape);
    // Blocks compute in f32 (attn_kernels::block), so f64 results are judged as f32 ones.
    let cpu = CpuBackend::new(1).unwrap();
    let (out, lse) = cpu.forward_vec(&cfg(), shape, &q, &k, &v).unwrap();
    let (dq, dk, dv) = cpu.backward_vec(&cfg(), shape, [&q, &k, &v], &out, &lse, &go).unwrap();
    if let Err(e) = judge(&cfg(), attn, [&q, &k, &v, &go], &out, &lse, [&dq, &dk, &dv]) {
        panic!("{:?} single device: {e}", T::DTYPE);
    }
    let view = |x| TensorView::contiguous(TensorName::Query, x, shape).unwrap();
    for world in [2, 3, 5] {
        for strategy in [Strategy::Ring, Strategy::AllGather] {
            let got = run_in_process(world, &cfg(), Layout::Zigzag, strategy, view(&q), view(&k), view(&v)).unwrap();
            // The backward reads grad_out in place in this dtype.
            let g = run_in_process_backward(
                world,
                &cfg(),
                Layout::Zigzag,
                strategy,
                [view(&q), view(&k), view(&v)],
                view(&go),
            )
            .unwrap();
            if let Err(e) = judge(&cfg(), attn, [&q, &k, &v, &go], &got.out, &got.lse, [&g.dq, &g.dk, &g.dv]) {
                panic!("{:?} p={world} {strategy:?}: {e}", T::DTYPE);
            }
        }
    }
}

#[test]
fn half_precision_and_f64_match_the_single_device_backend() {
    check_dtype::<bf16>();
    check_dtype::<f16>();
    check_dtype::<f64>();
}

#[test]
fn fused_qkv_views_feed_the_ring_without_copies() {
    let (p, shape) = (3, Shape4::new(1, 29, 2, 8).unwrap());
    let fused = random_vec(9, shape.numel() * 3);
    let [q, k, v] = TensorView::fused_qkv(&fused, shape).unwrap();
    let want = run_in_process(p, &cfg(), Layout::Contiguous, Strategy::Ring, q, k, v).unwrap();
    let problem = problem_for(&cfg(), shape, Layout::Contiguous, Strategy::Ring, p);
    let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = ThreadComm::world(p)
            .unwrap()
            .into_iter()
            .map(|mut c| {
                let (problem, fused) = (&problem, &fused);
                s.spawn(move || {
                    let pos = Layout::Contiguous.positions(shape.seq, p, attn_ring::Communicator::rank(&c));
                    let ls = shape.with_seq(pos.len()).unwrap();
                    // This rank's rows of the fused buffer, still fused: [rows, 3, heads, d].
                    let rows: Vec<f32> =
                        pos.iter().flat_map(|&i| fused[i * 3 * 16..(i + 1) * 3 * 16].to_vec()).collect();
                    let [lq, lk, lv] = TensorView::fused_qkv(&rows, ls).unwrap();
                    let mut out = vec![0.0f32; ls.numel()];
                    let mut lse = vec![0.0f32; ls.lse_len()];
                    let mut ov = TensorViewMut::contiguous(TensorName::Output, &mut out, ls).unwrap();
                    ring_forward(&mut c, problem, [lq, lk, lv], &mut ov, &mut lse).unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let got: Vec<f32> = outs.concat();
    let ov = TensorView::contiguous(TensorName::Output, &want.out, shape).unwrap();
    assert_eq!(got, local_rows(&ov, &(0..shape.seq).collect::<Vec<_>>()).unwrap());
}

#[test]
fn long_local_rows_span_several_accumulator_chunks() {
    // 700 rows over 2 ranks: 350 local rows, more than one 256-row chunk of the direct path.
    let shape = Shape4::new(1, 700, 2, 8).unwrap();
    let cfg = DilatedConfig::builder().segments(&[64, 512]).dilations(&[1, 2]).mixing(Mixing::LongNet).build().unwrap();
    let (q, k, v) = (random_vec(21, shape.numel()), random_vec(22, shape.numel()), random_vec(23, shape.numel()));
    let (want, want_lse) = CpuBackend::new(1).unwrap().forward_vec(&cfg, shape, &q, &k, &v).unwrap();
    let view = |x| TensorView::contiguous(TensorName::Query, x, shape).unwrap();
    for (layout, strategy) in [(Layout::Contiguous, Strategy::AllGather), (Layout::Zigzag, Strategy::Auto)] {
        let got = run_in_process(2, &cfg, layout, strategy, view(&q), view(&k), view(&v)).unwrap();
        let (e, el) = (rel_l2_error(&got.out, &want), rel_l2_error(&got.lse, &want_lse));
        let tol = Tolerance::for_dtype(DType::F32);
        assert!(tol.accepts(e) && tol.accepts(el), "{layout:?} {strategy:?}: {e:e} {el:e}");
    }
}
