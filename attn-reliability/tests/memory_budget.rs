//! Memory budgets: `CpuBackend::workspace_bytes(cfg, shape, pass)` is a true upper
//! bound on what a forward or backward call allocates (measured by the counting
//! allocator), so a caller can refuse a call up front with `MemoryBudget` before any
//! allocation, and a budget of exactly `workspace_bytes` is enough.

use attn_core::error::TensorName;
use attn_core::{Attention, AttnError, AttnInputs, DilatedConfig, Grads, MemoryBudget, Mixing, Pass, Saved, Shape4};
use attn_core::{TensorView, TensorViewMut};
use attn_kernels::CpuBackend;
use attn_reliability::counting_alloc::{self, CountingAlloc, measure};
use attn_testkit::rng::random_vec;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn cases() -> Vec<(DilatedConfig, Shape4)> {
    let b = DilatedConfig::builder;
    vec![
        (b().segments(&[16, 64]).dilations(&[1, 2]).build().unwrap(), Shape4::new(1, 64, 2, 16).unwrap()),
        (
            b().segments(&[32, 128, 512]).dilations(&[1, 2, 4]).mixing(Mixing::LongNet).causal().build().unwrap(),
            Shape4::new(2, 300, 3, 24).unwrap(),
        ),
        (b().segments(&[512]).dilations(&[1]).causal().build().unwrap(), Shape4::new(1, 512, 1, 64).unwrap()),
        (b().segments(&[7, 13]).dilations(&[2, 3]).build().unwrap(), Shape4::new(3, 50, 2, 5).unwrap()),
    ]
}

/// Peak extra bytes of one forward and one backward, outputs allocated beforehand.
fn measured(cpu: &CpuBackend, cfg: &DilatedConfig, s: Shape4) -> (usize, usize) {
    let n = s.numel();
    let (q, k, v, go) = (random_vec(1, n), random_vec(2, n), random_vec(3, n), random_vec(4, n));
    let view = |x| TensorView::contiguous(TensorName::Other("in"), x, s).unwrap();
    let mut out = vec![0.0f32; n];
    let mut lse = vec![0.0f32; s.lse_len()];
    let (r, fwd) = measure(|| {
        let ov = TensorViewMut::contiguous(TensorName::Output, &mut out, s).unwrap();
        cpu.forward(&AttnInputs::new(cfg, view(&q), view(&k), view(&v)), ov, &mut lse)
    });
    r.unwrap();
    let [mut dq, mut dk, mut dv] = [0; 3].map(|_| vec![0.0f32; n]);
    let (r, bwd) = measure(|| {
        let m = |x| TensorViewMut::contiguous(TensorName::Other("grad"), x, s).unwrap();
        let grads = Grads { dq: m(&mut dq), dk: m(&mut dk), dv: m(&mut dv) };
        cpu.backward(
            &AttnInputs::new(cfg, view(&q), view(&k), view(&v)),
            Saved { out: view(&out), lse: &lse },
            view(&go),
            grads,
        )
    });
    r.unwrap();
    (fwd.peak_extra, bwd.peak_extra)
}

#[test]
fn workspace_bytes_bounds_what_calls_allocate() {
    let _g = counting_alloc::exclusive();
    for threads in [1, 2] {
        let cpu = CpuBackend::new(threads).unwrap();
        for (cfg, s) in cases() {
            // Twice, so lazily initialised state does not count as workspace.
            measured(&cpu, &cfg, s);
            let (fwd, bwd) = measured(&cpu, &cfg, s);
            let (wf, wb) = (cpu.workspace_bytes(&cfg, s, Pass::Forward), cpu.workspace_bytes(&cfg, s, Pass::Backward));
            eprintln!("threads={threads} {:?}: forward {fwd} <= {wf}, backward {bwd} <= {wb}", s.dims());
            assert!(
                fwd <= wf,
                "forward allocated {fwd} bytes, workspace_bytes says {wf} ({cfg:?}, {s:?}, {threads} threads)"
            );
            assert!(
                bwd <= wb,
                "backward allocated {bwd} bytes, workspace_bytes says {wb} ({cfg:?}, {s:?}, {threads} threads)"
            );
        }
    }
}

fn input(s: Shape4, x: &[f32]) -> TensorView<'_, f32> {
    TensorView::contiguous(TensorName::Other("in"), x, s).unwrap()
}

#[test]
fn a_budget_below_the_workspace_is_refused_before_allocating() {
    let _g = counting_alloc::exclusive();
    for (cfg, s) in cases() {
        let free = CpuBackend::new(2).unwrap();
        let n = s.numel();
        let (q, k, v, go) = (random_vec(1, n), random_vec(2, n), random_vec(3, n), random_vec(4, n));
        let mut out = vec![0.0f32; n];
        let mut lse = vec![0.0f32; s.lse_len()];
        let [mut dq, mut dk, mut dv] = [0; 3].map(|_| vec![0.0f32; n]);
        for pass in [Pass::Forward, Pass::Backward] {
            let need = free.workspace_bytes(&cfg, s, pass);
            let tight = CpuBackend::new(2).unwrap().with_budget(MemoryBudget::bytes(need - 1));
            let (r, m) = if pass == Pass::Backward {
                measure(|| {
                    let g = |x| TensorViewMut::contiguous(TensorName::Other("grad"), x, s).unwrap();
                    let (o, gq, gk, gv) = (input(s, &out), g(&mut dq), g(&mut dk), g(&mut dv));
                    let inputs = AttnInputs::new(&cfg, input(s, &q), input(s, &k), input(s, &v));
                    tight.backward(
                        &inputs,
                        Saved { out: o, lse: &lse },
                        input(s, &go),
                        Grads { dq: gq, dk: gk, dv: gv },
                    )
                })
            } else {
                measure(|| {
                    let ov = TensorViewMut::contiguous(TensorName::Output, &mut out, s).unwrap();
                    tight.forward(&AttnInputs::new(&cfg, input(s, &q), input(s, &k), input(s, &v)), ov, &mut lse)
                })
            };
            assert!(
                matches!(r, Err(AttnError::OverBudget { needed, budget }) if needed == need && budget == need - 1),
                "{r:?}"
            );
            // Only the work-list estimate is computed before refusing: nothing near the scratch size.
            assert!(m.peak_extra <= 4096, "refusing a call allocated {} bytes (scratch {need})", m.peak_extra);
        }
        // With the budget at exactly the workspace both calls run and their real peaks fit.
        let (need_f, need_b) =
            (free.workspace_bytes(&cfg, s, Pass::Forward), free.workspace_bytes(&cfg, s, Pass::Backward));
        let exact = CpuBackend::new(2).unwrap().with_budget(MemoryBudget::bytes(need_f.max(need_b)));
        let (fwd, bwd) = measured(&exact, &cfg, s);
        assert!(fwd <= need_f && bwd <= need_b, "{fwd} > {need_f} or {bwd} > {need_b}");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: attn_testkit::proptest_cases(48), max_shrink_iters: 50, ..Default::default() })]

    #[test]
    fn workspace_bound_holds_on_random_cases(case in attn_testkit::strategies::dilated_case_with(200, 96)) {
        let _g = counting_alloc::exclusive();
        let cpu = CpuBackend::new(2).unwrap();
        measured(&cpu, &case.cfg, case.shape);
        let (fwd, bwd) = measured(&cpu, &case.cfg, case.shape);
        proptest::prop_assert!(fwd <= cpu.workspace_bytes(&case.cfg, case.shape, Pass::Forward), "forward {fwd}");
        proptest::prop_assert!(bwd <= cpu.workspace_bytes(&case.cfg, case.shape, Pass::Backward), "backward {bwd}");
    }
}
