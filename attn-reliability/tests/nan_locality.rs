//! A NaN or Inf in one input row reaches only the outputs that read it (computed from
//! the pattern math), on the CPU backend and the float64 reference; and `check_finite`
//! names the tensor and the first bad flat index, for contiguous and fused views.

use attn_core::error::TensorName;
use attn_core::reference;
use attn_core::{AttnError, AttnShape, DilatedConfig, Mixing, Shape4, TensorView, check_finite};
use attn_kernels::CpuBackend;
use attn_reliability::readers::{queries_reading_key, row_index};
use attn_testkit::rng::random_vec;
use half::{bf16, f16};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Which {
    Q,
    K,
    V,
}

/// A forward: (q, k, v) -> (out, lse), widened to f64.
type Runner<'a> = dyn Fn(&[f32], &[f32], &[f32]) -> (Vec<f64>, Vec<f64>) + 'a;

fn configs() -> Vec<DilatedConfig> {
    let b = || DilatedConfig::builder().segments(&[4, 8, 16]).dilations(&[1, 2, 4]);
    vec![
        b().build().unwrap(),
        b().causal().build().unwrap(),
        b().mixing(Mixing::LongNet).build().unwrap(),
        b().mixing(Mixing::LongNet).causal().build().unwrap(),
    ]
}

/// Output rows `(b, i, h)` (as row indices) that read row `(b, p, h)` of `which`.
fn readers(cfg: &DilatedConfig, s: Shape4, which: Which, b: usize, p: usize, h: usize) -> Vec<usize> {
    let queries: Vec<usize> = match which {
        // A query row is read by its own output only if that row attends anything.
        Which::Q => queries_reading_key(cfg, s.heads, h, s.seq, p).contains(&p).then_some(p).into_iter().collect(),
        Which::K | Which::V => queries_reading_key(cfg, s.heads, h, s.seq, p).into_iter().collect(),
    };
    queries.into_iter().map(|i| row_index(s.seq, s.heads, b, i, h)).collect()
}

/// Poison one row and compare every output row with the clean run. Returns the rows that
/// changed although they do not read the poisoned row (leaks), and the reading rows that
/// came out finite although they read a NaN (a NaN silently dropped).
fn check_locality(run: &Runner<'_>, cfg: &DilatedConfig, s: Shape4, label: &str) -> (Vec<String>, Vec<String>) {
    let (mut leaks, mut dropped) = (Vec::new(), Vec::new());
    let n = s.numel();
    let d = s.head_dim;
    let base = [random_vec(31, n), random_vec(32, n), random_vec(33, n)];
    let (clean_out, clean_lse) = run(&base[0], &base[1], &base[2]);
    let mut poisoned_rows = 0;
    for which in [Which::Q, Which::K, Which::V] {
        for (b, p, h) in [(0, 0, 0), (1, 5, 1), (0, 13, 2), (1, s.seq - 1, 0)] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut x = base.clone();
                let slot = which as usize;
                x[slot][row_index(s.seq, s.heads, b, p, h) * d + 1] = bad;
                let (out, lse) = run(&x[0], &x[1], &x[2]);
                let read = readers(cfg, s, which, b, p, h);
                poisoned_rows += read.len();
                for r in 0..s.lse_len() {
                    let (o, co) = (&out[r * d..(r + 1) * d], &clean_out[r * d..(r + 1) * d]);
                    if read.contains(&r) {
                        if bad.is_nan() && o.iter().all(|v| v.is_finite()) {
                            dropped.push(format!(
                                "{label} {cfg:?}: NaN in {which:?} (b={b}, pos={p}, h={h}) -> output row {r} finite"
                            ));
                        }
                    } else {
                        let same = o.iter().zip(co).all(|(a, c)| a.to_bits() == c.to_bits());
                        if !same || lse[r].to_bits() != clean_lse[r].to_bits() {
                            let (rb, ri, rh) = (r / (s.seq * s.heads), r / s.heads % s.seq, r % s.heads);
                            leaks.push(format!(
                                "{label} causal={} {:?}: {bad} in {which:?} (b={b}, pos={p}, h={h}) changed output (b={rb}, pos={ri}, h={rh}) to {:?}, lse {} -> {}",
                                cfg.causal(), cfg.mixing(), &o[..2], clean_lse[r], lse[r]
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(poisoned_rows > 0);
    (leaks, dropped)
}

type Findings = (Vec<String>, Vec<String>);

fn cpu_findings(causal: bool) -> Findings {
    let s = Shape4::new(2, 24, 3, 8).unwrap();
    let cpu = CpuBackend::new(2).unwrap();
    let (mut leaks, mut dropped) = (Vec::new(), Vec::new());
    for cfg in configs().into_iter().filter(|c| c.causal() == causal) {
        let run = |q: &[f32], k: &[f32], v: &[f32]| {
            let (o, l) = cpu.forward_vec(&cfg, s, q, k, v).expect("forward");
            (o.iter().map(|&x| f64::from(x)).collect(), l.iter().map(|&x| f64::from(x)).collect())
        };
        let (l, d) = check_locality(&run, &cfg, s, "cpu");
        leaks.extend(l);
        dropped.extend(d);
    }
    (leaks, dropped)
}

fn reference_findings() -> Findings {
    let s = Shape4::new(2, 24, 3, 8).unwrap();
    let to64 = |x: &[f32]| x.iter().map(|&a| f64::from(a)).collect::<Vec<_>>();
    let (mut leaks, mut dropped) = (Vec::new(), Vec::new());
    for cfg in configs() {
        let run = |q: &[f32], k: &[f32], v: &[f32]| {
            let f = reference::dilated_forward(&cfg, AttnShape::self_attn(s), &to64(q), &to64(k), &to64(v)).unwrap();
            (f.out, f.lse)
        };
        let (l, d) = check_locality(&run, &cfg, s, "reference");
        leaks.extend(l);
        dropped.extend(d);
    }
    (leaks, dropped)
}

fn summary(v: &[String]) -> String {
    format!("{} cases, e.g.:\n{}", v.len(), v[..v.len().min(8)].join("\n"))
}

#[test]
fn poison_reaches_only_readers_on_the_cpu_backend() {
    let (leaks, _) = cpu_findings(false);
    assert!(leaks.is_empty(), "poison reached rows that do not read it: {}", summary(&leaks));
}

/// Found here first: with `causal`, a NaN/Inf in the VALUE row of a later position turned
/// earlier rows of the same key tile into NaN (masked weight 0, `0 * inf = NaN` in P.V).
#[test]
fn causal_poison_reaches_only_readers_on_the_cpu_backend() {
    let (leaks, _) = cpu_findings(true);
    assert!(leaks.is_empty(), "poison reached rows that do not read it: {}", summary(&leaks));
}

#[test]
fn poison_reaches_only_readers_on_the_reference() {
    let (leaks, _) = reference_findings();
    assert!(leaks.is_empty(), "poison reached rows that do not read it: {}", summary(&leaks));
}

#[test]
fn a_nan_read_by_an_output_row_makes_it_non_finite_on_the_reference() {
    let (_, dropped) = reference_findings();
    assert!(dropped.is_empty(), "NaNs silently dropped: {}", summary(&dropped));
}

/// Found here first: on the CPU backend a NaN in a query or key row was silently dropped
/// (NaN scores never won the running max, so the row ended as if those keys were masked).
#[test]
fn a_nan_read_by_an_output_row_makes_it_non_finite_on_the_cpu_backend() {
    let (_, mut dropped) = cpu_findings(false);
    dropped.extend(cpu_findings(true).1);
    assert!(dropped.is_empty(), "NaNs silently dropped: {}", summary(&dropped));
}

#[test]
fn check_finite_names_tensor_and_first_index() {
    let s = Shape4::new(2, 3, 2, 4).unwrap();
    let mut data = random_vec(5, s.numel());
    let v = TensorView::contiguous(TensorName::Value, &data, s).unwrap();
    assert!(check_finite(TensorName::Value, &v).is_ok());
    // Finite extremes are not flagged.
    data[0] = f32::MAX;
    data[1] = -0.0;
    data[2] = 1e-45;
    assert!(check_finite(TensorName::Value, &TensorView::contiguous(TensorName::Value, &data, s).unwrap()).is_ok());
    data[30] = f32::NEG_INFINITY;
    data[17] = f32::NAN;
    data[40] = f32::INFINITY;
    let got = check_finite(TensorName::Value, &TensorView::contiguous(TensorName::Value, &data, s).unwrap());
    assert!(matches!(got, Err(AttnError::NonFinite { tensor: TensorName::Value, index: 17 })), "{got:?}");

    // Fused [batch, seq, 3, heads, head_dim]: the index is the logical one of k, not the buffer offset.
    let mut fused = random_vec(6, 3 * s.numel());
    let (b, p, h, e) = (1, 2, 1, 3);
    let k_offset = ((b * s.seq + p) * 3 + 1) * s.heads * s.head_dim + h * s.head_dim + e;
    fused[k_offset] = f32::NAN;
    let [qv, kv, vv] = TensorView::fused_qkv(&fused, s).unwrap();
    assert!(check_finite(TensorName::Query, &qv).is_ok() && check_finite(TensorName::Value, &vv).is_ok());
    let want = row_index(s.seq, s.heads, b, p, h) * s.head_dim + e;
    let got = check_finite(TensorName::Key, &kv);
    assert!(matches!(got, Err(AttnError::NonFinite { tensor: TensorName::Key, index }) if index == want), "{got:?}");

    // Half types.
    let mut h16: Vec<f16> = data.iter().map(|_| f16::from_f32(0.5)).collect();
    h16[9] = f16::INFINITY;
    let got = check_finite(TensorName::Query, &TensorView::contiguous(TensorName::Query, &h16, s).unwrap());
    assert!(matches!(got, Err(AttnError::NonFinite { tensor: TensorName::Query, index: 9 })));
    let mut hb: Vec<bf16> = data.iter().map(|_| bf16::from_f32(0.5)).collect();
    hb[44] = bf16::NAN;
    let got = check_finite(TensorName::GradOutput, &TensorView::contiguous(TensorName::GradOutput, &hb, s).unwrap());
    assert!(matches!(got, Err(AttnError::NonFinite { tensor: TensorName::GradOutput, index: 44 })));
}

/// Backward locality for a poisoned VALUE row `p` of head `h`: `dv` never depends on `v`,
/// `dq_i` only through rows `i` that read `p`, and `dk_j` only through queries that attend
/// `j` AND read `p`. Everything else must be bit-identical to the clean gradients.
#[test]
fn value_poison_reaches_only_the_gradients_that_read_it() {
    let s = Shape4::new(1, 24, 3, 8).unwrap();
    let (n, d) = (s.numel(), s.head_dim);
    let cpu = CpuBackend::new(2).unwrap();
    let x = [random_vec(51, n), random_vec(52, n), random_vec(53, n), random_vec(54, n)];
    let grads = |cfg: &DilatedConfig, v: &[f32]| {
        let (out, lse) = cpu.forward_vec(cfg, s, &x[0], &x[1], v).unwrap();
        cpu.backward_vec(cfg, s, [&x[0], &x[1], v], &out, &lse, &x[3]).unwrap()
    };
    let (mut leaks, mut reached) = (Vec::new(), 0);
    for cfg in configs() {
        let (cq, ck, cv) = grads(&cfg, &x[2]);
        for (p, h) in [(3, 0), (13, 1), (23, 2)] {
            for bad in [f32::NAN, f32::INFINITY] {
                let mut v = x[2].clone();
                v[row_index(s.seq, s.heads, 0, p, h) * d] = bad;
                let (gq, gk, gv) = grads(&cfg, &v);
                let readers_of_p = queries_reading_key(&cfg, s.heads, h, s.seq, p);
                for pos in 0..s.seq {
                    for head in 0..s.heads {
                        let r = row_index(s.seq, s.heads, 0, pos, head) * d
                            ..row_index(s.seq, s.heads, 0, pos, head) * d + d;
                        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                        let dq_may = head == h && readers_of_p.contains(&pos);
                        let dk_may =
                            head == h && !queries_reading_key(&cfg, s.heads, h, s.seq, pos).is_disjoint(&readers_of_p);
                        for (name, may, got, clean) in
                            [("dq", dq_may, &gq, &cq), ("dk", dk_may, &gk, &ck), ("dv", false, &gv, &cv)]
                        {
                            let changed = !same(&got[r.clone()], &clean[r.clone()]);
                            reached += usize::from(changed && may);
                            if !may && changed {
                                leaks.push(format!(
                                    "causal={} {:?}: {bad} in v (pos={p}, h={h}) changed {name} (pos={pos}, h={head})",
                                    cfg.causal(),
                                    cfg.mixing()
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(leaks.is_empty(), "poison reached gradients that do not read it: {}", summary(&leaks));
    assert!(reached > 0, "the poison changed no gradient at all: the test would prove nothing");
    eprintln!("{reached} gradient rows that read the poison changed; none of the others did");
}
