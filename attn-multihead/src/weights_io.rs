//! Safetensors load/save of any `NamedParams` module with PyTorch names; missing, extra or misshapen tensors are named errors.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use attn_core::{AttnError, Result};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::float::LayerFloat;
use crate::weights::NamedParams;

/// What to do with file tensors that are not parameters of the module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtraTensors {
    /// An unknown tensor is an error (loading a checkpoint).
    Reject,
    /// Unknown tensors are skipped (a file that also holds inputs and outputs).
    Ignore,
}

fn format_err(e: impl std::fmt::Display) -> AttnError {
    AttnError::Format(format!("safetensors: {e}"))
}

/// Decode one tensor's bytes (F32, F64, F16 or BF16 on disk) into `dst`.
fn decode_into<F: LayerFloat>(name: &str, dtype: Dtype, bytes: &[u8], dst: &mut [F]) -> Result<()> {
    let size = match dtype {
        Dtype::F32 => 4,
        Dtype::F64 => 8,
        Dtype::F16 | Dtype::BF16 => 2,
        other => return Err(AttnError::Format(format!("tensor `{name}` has unsupported dtype {other:?}"))),
    };
    if bytes.len() != dst.len() * size {
        return Err(AttnError::Format(format!(
            "tensor `{name}` holds {} bytes, {} expected",
            bytes.len(),
            dst.len() * size
        )));
    }
    for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(size)) {
        *d = match dtype {
            Dtype::F32 => F::of(f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64),
            Dtype::F64 => F::of(f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])),
            Dtype::F16 => F::of(f16::from_le_bytes([c[0], c[1]]).to_f64()),
            _ => F::of(bf16::from_le_bytes([c[0], c[1]]).to_f64()),
        };
    }
    Ok(())
}

/// Where named tensors come from: a safetensors file, or float32 tensors in memory.
pub trait TensorSource {
    /// Every tensor name.
    fn tensor_names(&self) -> Vec<String>;
    /// The shape of a tensor, `None` if absent.
    fn tensor_shape(&self, name: &str) -> Option<Vec<usize>>;
    /// Decode a tensor into `dst` (its length must be the tensor's element count).
    fn read_into<F: LayerFloat>(&self, name: &str, dst: &mut [F]) -> Result<()>;

    /// A whole tensor as `F` with its shape.
    fn read_tensor<F: LayerFloat>(&self, name: &str) -> Result<(Vec<usize>, Vec<F>)> {
        let shape = self.tensor_shape(name).ok_or_else(|| AttnError::Format(format!("missing tensor `{name}`")))?;
        let n = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| AttnError::Format(format!("tensor `{name}`: shape {shape:?} overflows")))?;
        // A shape no buffer can hold (the source's own claim) is an error, not an abort.
        let mut v = Vec::new();
        v.try_reserve_exact(n)
            .map_err(|_| AttnError::Format(format!("tensor `{name}`: shape {shape:?} is too large to allocate")))?;
        v.resize(n, F::zero());
        self.read_into(name, &mut v)?;
        Ok((shape, v))
    }
}

impl TensorSource for SafeTensors<'_> {
    fn tensor_names(&self) -> Vec<String> {
        self.names().into_iter().map(str::to_string).collect()
    }
    fn tensor_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensor(name).ok().map(|t| t.shape().to_vec())
    }
    fn read_into<F: LayerFloat>(&self, name: &str, dst: &mut [F]) -> Result<()> {
        let t = self.tensor(name).map_err(|_| AttnError::Format(format!("missing tensor `{name}`")))?;
        decode_into(name, t.dtype(), t.data(), dst)
    }
}

/// Float32 tensors held in memory (e.g. a parsed golden case): name -> (shape, data).
#[derive(Debug, Clone, Default)]
pub struct F32Tensors<'a> {
    pub tensors: BTreeMap<String, (&'a [usize], &'a [f32])>,
}

impl TensorSource for F32Tensors<'_> {
    fn tensor_names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }
    fn tensor_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensors.get(name).map(|(s, _)| s.to_vec())
    }
    fn read_into<F: LayerFloat>(&self, name: &str, dst: &mut [F]) -> Result<()> {
        let (_, data) = self.tensors.get(name).ok_or_else(|| AttnError::Format(format!("missing tensor `{name}`")))?;
        if data.len() != dst.len() {
            return Err(AttnError::Format(format!(
                "tensor `{name}` holds {} values, {} expected",
                data.len(),
                dst.len()
            )));
        }
        dst.iter_mut().zip(data.iter()).for_each(|(d, &x)| *d = F::of(x as f64));
        Ok(())
    }
}

/// Load every parameter of `module` from a tensor source.
///
/// Every parameter must be present with exactly its PyTorch shape; with
/// [`ExtraTensors::Reject`], every tensor in the source must be a parameter.
/// On error the module is unchanged.
pub fn load_params<F: LayerFloat>(
    module: &mut impl NamedParams<F>,
    source: &impl TensorSource,
    extra: ExtraTensors,
) -> Result<()> {
    let mut known = BTreeSet::new();
    for p in module.params() {
        let shape =
            source.tensor_shape(&p.name).ok_or_else(|| AttnError::Format(format!("missing tensor `{}`", p.name)))?;
        if shape != p.shape {
            return Err(AttnError::Format(format!(
                "tensor `{}` has shape {shape:?} but {:?} was expected",
                p.name, p.shape
            )));
        }
        known.insert(p.name);
    }
    if extra == ExtraTensors::Reject {
        let mut names = source.tensor_names();
        names.sort_unstable();
        if let Some(unknown) = names.into_iter().find(|n| !known.contains(n)) {
            return Err(AttnError::Format(format!("unexpected tensor `{unknown}` (not a parameter of this module)")));
        }
    }
    let mut staged = Vec::new();
    for p in module.params() {
        let mut v = vec![F::zero(); p.data.len()];
        source.read_into(&p.name, &mut v)?;
        staged.push(v);
    }
    for (p, v) in module.params_mut().into_iter().zip(staged) {
        p.data.copy_from_slice(&v);
    }
    Ok(())
}

/// Load from safetensors bytes, rejecting unknown tensors.
pub fn load_bytes<F: LayerFloat>(module: &mut impl NamedParams<F>, bytes: &[u8]) -> Result<()> {
    let file = SafeTensors::deserialize(bytes).map_err(format_err)?;
    load_params(module, &file, ExtraTensors::Reject)
}

/// Load from a `.safetensors` file, rejecting unknown tensors.
pub fn load_file<F: LayerFloat>(module: &mut impl NamedParams<F>, path: impl AsRef<Path>) -> Result<()> {
    let bytes = std::fs::read(path.as_ref())
        .map_err(|e| AttnError::Format(format!("cannot read {}: {e}", path.as_ref().display())))?;
    load_bytes(module, &bytes)
}

/// Serialise every parameter (in `F`'s dtype) with optional string metadata.
pub fn save_bytes<F: LayerFloat>(
    module: &impl NamedParams<F>,
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let params = module.params();
    let buffers: Vec<Vec<u8>> = params
        .iter()
        .map(|p| {
            let mut b = Vec::with_capacity(std::mem::size_of_val(p.data));
            p.data.iter().for_each(|x| x.push_le(&mut b));
            b
        })
        .collect();
    let mut views = Vec::with_capacity(params.len());
    for (p, b) in params.iter().zip(&buffers) {
        let view =
            safetensors::tensor::TensorView::new(F::SAFETENSORS_DTYPE, p.shape.clone(), b).map_err(format_err)?;
        views.push((p.name.clone(), view));
    }
    safetensors::serialize(views, metadata).map_err(format_err)
}

/// Write every parameter to a `.safetensors` file.
pub fn save_file<F: LayerFloat>(
    module: &impl NamedParams<F>,
    path: impl AsRef<Path>,
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let bytes = save_bytes(module, metadata)?;
    std::fs::write(path.as_ref(), bytes)
        .map_err(|e| AttnError::Format(format!("cannot write {}: {e}", path.as_ref().display())))
}
