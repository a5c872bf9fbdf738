//! [`ReferenceBackend`]: the float64 reference behind the [`Attention`] interface, for any
//! element type (converted to f64 and back). Slow; for conformance and gradient checks.

use crate::attention::{Attention, AttnInputs, Grads, Pass, Saved, Supported};
use crate::config::DilatedConfig;
use crate::element::Element;
use crate::error::{AttnError, Result, TensorName};
use crate::shape::AttnShape;
use crate::view::{TensorView, TensorViewMut};

use super::{dilated_backward_lse, dilated_forward_masked};

/// The float64 reference as a backend.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceBackend;

/// Write the row-major `src` into the strided `dst`, converting each value.
fn write_rows<T: Element>(dst: &mut TensorViewMut<'_, T>, src: &[f64], name: TensorName) -> Result<()> {
    let s = dst.shape();
    if src.len() != s.numel() {
        return Err(AttnError::ShapeMismatch { tensor: name, expected: vec![s.numel()], got: vec![src.len()] });
    }
    let mut rows = src.chunks_exact(s.head_dim);
    for b in 0..s.batch {
        for t in 0..s.seq {
            for h in 0..s.heads {
                if let Some(r) = rows.next() {
                    for (o, &x) in dst.row_mut(b, t, h).iter_mut().zip(r) {
                        *o = T::from_f64(x);
                    }
                }
            }
        }
    }
    Ok(())
}

/// `view`'s shape must be `want`.
fn expect_shape<T: Element>(view: &TensorViewMut<'_, T>, want: crate::shape::Shape4, name: TensorName) -> Result<()> {
    if view.shape() != want {
        return Err(AttnError::ShapeMismatch {
            tensor: name,
            expected: want.dims().to_vec(),
            got: view.shape().dims().to_vec(),
        });
    }
    Ok(())
}

impl<T: Element> Attention<T> for ReferenceBackend {
    fn name(&self) -> &str {
        "reference"
    }

    fn forward(&self, inputs: &AttnInputs<'_, T>, mut out: TensorViewMut<'_, T>, lse: &mut [f32]) -> Result<()> {
        let shape = inputs.shape_for("reference", Supported::ALL)?;
        expect_shape(&out, shape.q, TensorName::Output)?;
        if lse.len() != shape.q.lse_len() {
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::Lse,
                expected: vec![shape.q.lse_len()],
                got: vec![lse.len()],
            });
        }
        let (q, k, v) = (inputs.q.to_f64_vec(), inputs.k.to_f64_vec(), inputs.v.to_f64_vec());
        let f = dilated_forward_masked(inputs.cfg, shape, inputs.masks, [&q, &k, &v])?;
        write_rows(&mut out, &f.out, TensorName::Output)?;
        for (l, &x) in lse.iter_mut().zip(&f.lse) {
            *l = x as f32;
        }
        Ok(())
    }

    fn backward_with_lse_grad(
        &self,
        inputs: &AttnInputs<'_, T>,
        _saved: Saved<'_, T>,
        grad_out: TensorView<'_, T>,
        grad_lse: Option<&[f32]>,
        mut grads: Grads<'_, T>,
    ) -> Result<()> {
        let shape = inputs.shape_for("reference", Supported::ALL)?;
        expect_shape(&grads.dq, shape.q, TensorName::GradQuery)?;
        expect_shape(&grads.dk, shape.kv, TensorName::GradKey)?;
        expect_shape(&grads.dv, shape.kv, TensorName::GradValue)?;
        let (q, k, v) = (inputs.q.to_f64_vec(), inputs.k.to_f64_vec(), inputs.v.to_f64_vec());
        let g_lse = grad_lse.map(|g| g.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>());
        let (_, g, _) = dilated_backward_lse(
            inputs.cfg,
            shape,
            inputs.masks,
            [&q, &k, &v],
            &grad_out.to_f64_vec(),
            g_lse.as_deref(),
        )?;
        write_rows(&mut grads.dq, &g.dq, TensorName::GradQuery)?;
        write_rows(&mut grads.dk, &g.dk, TensorName::GradKey)?;
        write_rows(&mut grads.dv, &g.dv, TensorName::GradValue)
    }

    /// The f64 copies of the inputs, results and magnitudes, and one query row's score
    /// lists (at most every pattern's keys of the whole key sequence).
    fn workspace_bytes(&self, cfg: &DilatedConfig, shape: AttnShape, pass: Pass) -> usize {
        let (q, kv, lse) = (shape.q.numel() as u128, shape.kv.numel() as u128, shape.q.lse_len() as u128);
        let row_keys = cfg.num_patterns() as u128 * shape.kv.seq as u128;
        let values = match pass {
            Pass::Forward => 2 * q + 2 * kv + lse + 2 * row_keys,
            // q, k, v, grad_out; out, lse; dq, dk, dv; their magnitudes; per-row lists.
            Pass::Backward => 5 * q + 6 * kv + 3 * lse + 4 * row_keys,
        };
        usize::try_from(8 * values).unwrap_or(usize::MAX)
    }
}
