//! Bad inputs are candle errors carrying the workspace's `AttnError` message, never
//! panics; the backward reads the forward's LSE instead of recomputing the forward; an
//! op computes one forward, and inputs candle does not track get no gradient.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use attn_candle::{AttnOptions, DilatedAttentionOp, attention_on, dilated_attention};
use attn_core::{Attention, AttnInputs, DilatedConfig, Element, Grads, Pass, Result, Saved};
use attn_core::{AttnShape, TensorView, TensorViewMut};
use attn_kernels::CpuBackend;
use candle_core::{CustomOp3, DType, Device, Tensor, Var};

fn opts() -> AttnOptions {
    AttnOptions::new(DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).build().expect("config"))
}

fn randn(dims: &[usize], dtype: DType) -> Tensor {
    Tensor::randn(0f32, 1.0, dims, &Device::Cpu).and_then(|t| t.to_dtype(dtype)).expect("tensor")
}

fn message(q: &Tensor, k: &Tensor, v: &Tensor) -> String {
    match dilated_attention(q, k, v, &opts()) {
        Ok(_) => panic!("accepted q {:?} {:?}, k {:?} {:?}", q.dims(), q.dtype(), k.dims(), k.dtype()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn wrong_dtype_rank_or_shape_is_an_error_naming_it() {
    let x = randn(&[1, 8, 2, 4], DType::F32);
    let f64_x = randn(&[1, 8, 2, 4], DType::F64);
    let m = message(&f64_x, &f64_x, &f64_x);
    assert!(m.contains("q") && m.contains("f64"), "{m}");
    let m = message(&x, &randn(&[1, 8, 2, 4], DType::BF16), &x);
    assert!(m.contains("k") && m.contains("bf16"), "{m}");
    let ints = Tensor::zeros((1, 8, 2, 4), DType::U32, &Device::Cpu).expect("ints");
    assert!(message(&ints, &ints, &ints).contains("u32"));
    let m = message(&randn(&[8, 2, 4], DType::F32), &x, &x);
    assert!(m.contains("4") && m.contains("3"), "{m}");
    let m = message(&x, &randn(&[1, 8, 2, 5], DType::F32), &randn(&[1, 8, 2, 5], DType::F32));
    assert!(m.contains("shape") || m.contains("mismatch") || m.contains("expected"), "{m}");
    // Three key/value heads do not divide two query heads.
    let kv = randn(&[1, 8, 3, 4], DType::F32);
    assert!(message(&x, &kv, &kv).contains("3"));
    // Head groups need at least as many heads as patterns.
    let one = randn(&[1, 8, 1, 4], DType::F32);
    assert!(message(&one, &one, &one).to_lowercase().contains("head"));
}

/// The CPU backend, counting forward and backward calls (and backward calls that got a
/// gradient into the LSE).
#[derive(Debug)]
struct Counting {
    cpu: CpuBackend,
    forwards: AtomicUsize,
    backwards: AtomicUsize,
    with_lse_gradient: AtomicUsize,
}

impl Counting {
    fn new() -> Self {
        let zero = || AtomicUsize::new(0);
        Counting {
            cpu: CpuBackend::new(1).expect("cpu"),
            forwards: zero(),
            backwards: zero(),
            with_lse_gradient: zero(),
        }
    }
}

impl<T: Element> Attention<T> for Counting {
    fn name(&self) -> &str {
        "counting"
    }
    fn forward(&self, inputs: &AttnInputs<'_, T>, out: TensorViewMut<'_, T>, lse: &mut [f32]) -> Result<()> {
        self.forwards.fetch_add(1, Ordering::SeqCst);
        self.cpu.forward(inputs, out, lse)
    }
    fn backward_with_lse_grad(
        &self,
        i: &AttnInputs<'_, T>,
        s: Saved<'_, T>,
        g: TensorView<'_, T>,
        gl: Option<&[f32]>,
        d: Grads<'_, T>,
    ) -> Result<()> {
        self.backwards.fetch_add(1, Ordering::SeqCst);
        self.with_lse_gradient.fetch_add(usize::from(gl.is_some()), Ordering::SeqCst);
        self.cpu.backward_with_lse_grad(i, s, g, gl, d)
    }
    fn workspace_bytes(&self, cfg: &DilatedConfig, shape: AttnShape, pass: Pass) -> usize {
        Attention::<T>::workspace_bytes(&self.cpu, cfg, shape, pass)
    }
}

#[test]
fn the_backward_reads_the_kept_lse_without_a_second_forward() {
    let counting = Arc::new(Counting::new());
    let [q, k, v] = [0, 1, 2].map(|_| Var::from_tensor(&randn(&[2, 16, 2, 8], DType::F32)).expect("var"));
    let r = attention_on(counting.clone(), q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts()).expect("forward");
    let grads = r.out.sqr().and_then(|x| x.sum_all()).and_then(|l| l.backward()).expect("backward");
    assert!(grads.get(q.as_tensor()).is_some() && grads.get(v.as_tensor()).is_some());
    assert_eq!(counting.forwards.load(Ordering::SeqCst), 1);
    assert_eq!(r.lse.dims(), &[2, 16, 2]);
}

/// A loss of the output, of the LSE or of both runs one backward (one collective backward
/// on a ring rank, whichever of them each rank's loss uses); the LSE's gradient reaches it
/// only where the loss uses the LSE.
#[test]
fn one_backward_serves_the_output_and_the_lse() {
    let [q, k, v] = [0, 1, 2].map(|_| Var::from_tensor(&randn(&[2, 16, 2, 8], DType::F32)).expect("var"));
    for (name, which, with_lse) in [("out", 0, 0), ("lse", 1, 1), ("both", 2, 1)] {
        let counting = Arc::new(Counting::new());
        let r = attention_on(counting.clone(), q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts()).expect("forward");
        let (out, lse) = (r.out.sqr().and_then(|x| x.sum_all()).expect("out"), r.lse.sum_all().expect("lse"));
        let loss = [out.clone(), lse.clone(), (out + lse).expect("sum")][which].clone();
        let grads = loss.backward().expect("backward");
        assert!(grads.get(q.as_tensor()).is_some(), "{name}: no dq");
        assert_eq!(counting.backwards.load(Ordering::SeqCst), 1, "{name}: backward calls");
        assert_eq!(counting.with_lse_gradient.load(Ordering::SeqCst), with_lse, "{name}: with the LSE's gradient");
    }
}

#[test]
fn an_op_computes_one_forward_and_constants_get_no_gradient() {
    let backend = Arc::new(CpuBackend::new(1).expect("cpu"));
    let q = Var::from_tensor(&randn(&[1, 16, 2, 8], DType::F32)).expect("var");
    let (k, v) = (randn(&[1, 16, 2, 8], DType::F32), randn(&[1, 16, 2, 8], DType::F32));
    let op: Arc<Box<dyn CustomOp3 + Send + Sync>> =
        Arc::new(Box::new(DilatedAttentionOp::new(backend.clone(), Arc::new(opts()))));
    let first = q.as_tensor().apply_op3_arc(&k, &v, op.clone()).expect("first forward");
    // A second forward of the same op would replace the LSE the first graph's backward reads.
    let again = q.as_tensor().apply_op3_arc(&k, &v.affine(2.0, 0.0).expect("v"), op);
    let m = again.expect_err("a second forward of one op").to_string();
    assert!(m.contains("one op per call"), "{m}");
    let grads = first.sqr().and_then(|x| x.sum_all()).and_then(|l| l.backward()).expect("backward");
    let fresh = attention_on(backend, q.as_tensor(), &k, &v, &opts()).expect("fresh op");
    let want = fresh.out.sqr().and_then(|x| x.sum_all()).and_then(|l| l.backward()).expect("backward");
    let dq = |g: &candle_core::backprop::GradStore| g.get(q.as_tensor()).expect("dq").flatten_all().expect("flat");
    let diff = (dq(&grads) - dq(&want)).and_then(|d| d.abs()).and_then(|d| d.max(0)).expect("diff");
    assert_eq!(diff.to_scalar::<f32>().expect("scalar"), 0.0);
    assert!(grads.get(&k).is_none() && grads.get(&v).is_none(), "constants k and v were given gradients");
}
