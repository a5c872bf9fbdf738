//! Golden conformance files (`conformance/**.safetensors`): loading and metadata.
//!
//! A malformed file is an [`AttnError::Format`] naming the file and the problem;
//! nothing here panics or allocates a size a header merely declares.

mod check;

pub use crate::problem::Problem;
pub use check::{
    CaseReport, DilatedBackend, Forward32, Gradients32, MultiheadBackend, MultiheadGrads32, TensorCheck, check_case,
};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use attn_core::{
    AttnError, AttnShape, BlockDims, BlockMaskBuf, BlockPattern, DilatedConfig, KeyPaddingMask, Masks, Mixing,
    OwnedMasks, Result,
};
use safetensors::tensor::TensorView as StView;
use safetensors::{Dtype, SafeTensors};

/// Files larger than this are refused before reading (the conformance files are KBs).
pub const MAX_GOLDEN_BYTES: u64 = 256 << 20;

/// The loosest `rel_tol` a file may declare: a file cannot make its own check lax.
pub const MAX_REL_TOL: f64 = 1e-3;

/// The tensors every `kind=dilated` file must hold (`lse` too for LongNet and window
/// mixing, see [`GoldenCase::required_tensors`]).
const DILATED_TENSORS: [&str; 8] = ["q", "k", "v", "out", "grad_out", "dq", "dk", "dv"];

/// The tensors every `kind=multihead` file must hold besides its weights (`key` and
/// `value` too for cross-attention).
const MULTIHEAD_TENSORS: [&str; 2] = ["query", "out"];

/// A float32 tensor from a golden file.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// One conformance case: metadata strings, float32 tensors, and the masks of the
/// feature and block files (`key_padding_mask` U8 `[batch, key_seq]`, `cu_seqlens` I64,
/// `block_mask` U8 `[batch, heads, q_blocks, k_blocks]` over `block_size` positions).
#[derive(Debug, Clone)]
pub struct GoldenCase {
    pub name: String,
    pub meta: BTreeMap<String, String>,
    pub tensors: BTreeMap<String, Tensor>,
    /// `key_padding_mask` (`[batch, key_seq]`, `true` = padding), `cu_seqlens` and
    /// `block_mask`.
    pub masks: OwnedMasks,
}

fn fmt_err(name: &str, msg: impl std::fmt::Display) -> AttnError {
    AttnError::Format(format!("{name}: {msg}"))
}

fn parse_list(name: &str, key: &str, s: &str) -> Result<Vec<usize>> {
    s.split(',').map(|x| x.trim().parse::<usize>().map_err(|e| fmt_err(name, format!("{key}=`{s}`: {e}")))).collect()
}

impl GoldenCase {
    /// Parse a case from the bytes of a safetensors file.
    pub fn from_bytes(name: &str, bytes: &[u8]) -> Result<Self> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| fmt_err(name, e))?;
        let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| fmt_err(name, e))?;
        let meta: BTreeMap<String, String> = header
            .metadata()
            .as_ref()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        let mut case = GoldenCase { name: name.to_string(), meta, tensors: BTreeMap::new(), masks: OwnedMasks::none() };
        for (tname, view) in st.tensors() {
            case.add_tensor(tname, &view)?;
        }
        for t in case.required_tensors()? {
            case.tensor(t)?;
        }
        for t in case.multihead_gradient_names()?.unwrap_or_default() {
            case.tensor(&t)?;
        }
        case.check_block_pattern()?;
        Ok(case)
    }

    /// Store one tensor: F32 data, the U8 `key_padding_mask` (`[batch, key_seq]`, 0/1), the
    /// U8 `block_mask` (4-D, 0/1, over the metadata's `block_size`) or the I64 `cu_seqlens`
    /// (non-negative); anything else is a format error.
    fn add_tensor(&mut self, tname: String, view: &StView<'_>) -> Result<()> {
        let name = &self.name;
        let shape = view.shape().to_vec();
        let width = match (tname.as_str(), view.dtype()) {
            (_, Dtype::F32) => 4,
            ("key_padding_mask", Dtype::U8) if shape.len() == 2 => 1,
            ("block_mask", Dtype::U8) if shape.len() == 4 => 1,
            ("cu_seqlens", Dtype::I64) if shape.len() == 1 => 8,
            (_, dt) => return Err(fmt_err(name, format!("tensor `{tname}` has dtype {dt:?} and shape {shape:?}"))),
        };
        let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let raw = view.data();
        if numel.and_then(|n| n.checked_mul(width)) != Some(raw.len()) {
            return Err(fmt_err(name, format!("tensor `{tname}`: shape {shape:?} disagrees with {} bytes", raw.len())));
        }
        match width {
            1 if tname == "block_mask" => {
                let dims = BlockDims { batch: shape[0], heads: shape[1], q_blocks: shape[2], k_blocks: shape[3] };
                let mask = BlockMaskBuf::new(raw.to_vec(), dims, self.meta_usize("block_size")?)
                    .map_err(|e| fmt_err(name, e))?;
                self.masks = std::mem::take(&mut self.masks).with_block_mask(mask);
            }
            1 => {
                if let Some(x) = raw.iter().find(|&&x| x > 1) {
                    return Err(fmt_err(name, format!("key_padding_mask holds {x}, not 0 or 1")));
                }
                let flags = raw.iter().map(|&x| x == 1).collect();
                let mask = KeyPaddingMask::new(flags, shape[0], shape[1]).map_err(|e| fmt_err(name, e))?;
                self.masks = std::mem::take(&mut self.masks).with_key_padding(mask);
            }
            8 => {
                let vals = raw.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()));
                let cu: std::result::Result<Vec<usize>, _> = vals.map(usize::try_from).collect();
                let cu = cu.map_err(|_| fmt_err(name, "cu_seqlens holds a negative entry"))?;
                self.masks = std::mem::take(&mut self.masks).with_cu_seqlens(cu).map_err(|e| fmt_err(name, e))?;
            }
            _ => {
                let data = raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                self.tensors.insert(tname, Tensor { shape, data });
            }
        }
        Ok(())
    }

    /// Read and parse one file (refusing files over [`MAX_GOLDEN_BYTES`]).
    pub fn load(path: &Path) -> Result<Self> {
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let len = std::fs::metadata(path).map_err(|e| fmt_err(&name, e))?.len();
        if len > MAX_GOLDEN_BYTES {
            return Err(fmt_err(&name, format!("file of {len} bytes exceeds the {MAX_GOLDEN_BYTES}-byte limit")));
        }
        let bytes = std::fs::read(path).map_err(|e| fmt_err(&name, e))?;
        Self::from_bytes(&name, &bytes)
    }

    /// A metadata string.
    pub fn meta(&self, key: &str) -> Result<&str> {
        self.meta.get(key).map(String::as_str).ok_or_else(|| fmt_err(&self.name, format!("missing metadata `{key}`")))
    }

    fn meta_usize(&self, key: &str) -> Result<usize> {
        self.meta(key)?.trim().parse().map_err(|e| fmt_err(&self.name, format!("metadata `{key}`: {e}")))
    }

    fn meta_bool(&self, key: &str) -> Result<bool> {
        match self.meta(key)? {
            "true" | "True" | "1" => Ok(true),
            "false" | "False" | "0" => Ok(false),
            other => Err(fmt_err(&self.name, format!("metadata `{key}` = `{other}` is not a bool"))),
        }
    }

    /// `dilated` or `multihead`.
    pub fn kind(&self) -> Result<&str> {
        match self.meta("kind")? {
            k @ ("dilated" | "multihead") => Ok(k),
            other => Err(fmt_err(&self.name, format!("unknown kind `{other}`"))),
        }
    }

    /// The tensors the definition lists for this case's kind: every input, output and
    /// gradient, and `lse` where the mixing makes it part of the result (LongNet, window).
    pub fn required_tensors(&self) -> Result<Vec<&'static str>> {
        Ok(match self.kind()? {
            "dilated" => {
                let mut t = DILATED_TENSORS.to_vec();
                if matches!(self.meta("mixing")?, "longnet" | "window") {
                    t.push("lse");
                }
                t
            }
            _ => {
                let mut t = MULTIHEAD_TENSORS.to_vec();
                if self.meta.contains_key("cross_attention") && self.meta_bool("cross_attention")? {
                    t.extend(["key", "value"]);
                }
                t
            }
        })
    }

    /// The gradients a `kind=multihead` file with `grad_out` lists, by name: `d_query`,
    /// `d_key` and `d_value` in cross-attention, and `d.<parameter>` for every parameter
    /// tensor (`*.weight`, `*.bias`). `None` for a file without `grad_out` (forward only);
    /// a gradient without `grad_out` is a format error.
    pub fn multihead_gradient_names(&self) -> Result<Option<Vec<String>>> {
        let is_grad = |t: &str| t.starts_with("d.") || t.starts_with("d_");
        if self.kind()? != "multihead" {
            return Ok(None);
        }
        if !self.tensors.contains_key("grad_out") {
            return match self.tensors.keys().find(|t| is_grad(t)) {
                Some(t) => Err(fmt_err(&self.name, format!("gradient `{t}` without `grad_out`"))),
                None => Ok(None),
            };
        }
        let mut names = vec!["d_query".to_string()];
        if self.meta.contains_key("cross_attention") && self.meta_bool("cross_attention")? {
            names.extend(["d_key".to_string(), "d_value".to_string()]);
        }
        let params = self.tensors.keys().filter(|t| !is_grad(t) && (t.ends_with(".weight") || t.ends_with(".bias")));
        names.extend(params.map(|p| format!("d.{p}")));
        Ok(Some(names))
    }

    /// The file's relative-error bound, positive and at most [`MAX_REL_TOL`].
    pub fn rel_tol(&self) -> Result<f64> {
        let t: f64 = self.meta("rel_tol")?.parse().map_err(|e| fmt_err(&self.name, format!("rel_tol: {e}")))?;
        if !(t.is_finite() && t > 0.0) {
            return Err(fmt_err(&self.name, format!("rel_tol {t} is not positive")));
        }
        if t > MAX_REL_TOL {
            return Err(fmt_err(&self.name, format!("rel_tol {t} is looser than the cap {MAX_REL_TOL}")));
        }
        Ok(t)
    }

    pub fn causal(&self) -> Result<bool> {
        self.meta_bool("causal")
    }

    /// Integer metadata such as `num_heads`, `embed_dim`.
    pub fn usize_meta(&self, key: &str) -> Result<usize> {
        self.meta_usize(key)
    }

    /// Boolean metadata such as `layer_norm`, `cross_attention`.
    pub fn bool_meta(&self, key: &str) -> Result<bool> {
        self.meta_bool(key)
    }

    /// The attention config the file was made with (dilated patterns, or a window).
    pub fn config(&self) -> Result<DilatedConfig> {
        let scale = match self.meta.get("scale") {
            Some(s) => Some(s.parse::<f64>().map_err(|e| fmt_err(&self.name, format!("scale: {e}")))?),
            None => None,
        };
        if Mixing::parse(self.meta("mixing")?)? == Mixing::Window {
            let (left, right) = (self.meta_usize("window_left")?, self.meta_usize("window_right")?);
            return DilatedConfig::builder()
                .window(left, right)
                .causality(self.causal()?.into())
                .maybe_scale(scale)
                .build();
        }
        let segs = parse_list(&self.name, "segment_lengths", self.meta("segment_lengths")?)?;
        let rates = parse_list(&self.name, "dilation_rates", self.meta("dilation_rates")?)?;
        let mixing = Mixing::parse(self.meta("mixing")?)?;
        DilatedConfig::builder()
            .segments(&segs)
            .dilations(&rates)
            .mixing(mixing)
            .causality(self.causal()?.into())
            .maybe_scale(scale)
            .build()
    }

    /// A tensor by name, or a format error naming it.
    pub fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.tensors.get(name).ok_or_else(|| fmt_err(&self.name, format!("missing tensor `{name}`")))
    }

    /// The q/k/v shapes of a `kind=dilated` file (checked against each other and
    /// against `num_kv_heads` where the file gives it). A file with `kv_seq_len` is
    /// cross-attention: k and v have that sequence length, which may differ from q's.
    pub fn attn_shape(&self) -> Result<AttnShape> {
        let (q, k, v) = (self.tensor("q")?, self.tensor("k")?, self.tensor("v")?);
        let shape = match self.kv_seq_len()? {
            Some(m) => {
                let shape = AttnShape::check_cross(&q.shape, &k.shape, &v.shape)?;
                self.check_kv_seq_len(m, shape.kv.seq)?;
                shape
            }
            None => AttnShape::check(&q.shape, &k.shape, &v.shape)?,
        };
        self.check_kv_heads(shape.kv.heads)?;
        Ok(shape)
    }

    /// `kv_seq_len`, the key/value sequence length, where the file gives it.
    pub fn kv_seq_len(&self) -> Result<Option<usize>> {
        self.meta.contains_key("kv_seq_len").then(|| self.meta_usize("kv_seq_len")).transpose()
    }

    /// `kv_seq_len` must equal the key/value sequence length the tensors have.
    pub fn check_kv_seq_len(&self, meta: usize, tensors: usize) -> Result<()> {
        if meta != tensors {
            return Err(fmt_err(&self.name, format!("kv_seq_len = {meta} but the keys have {tensors} positions")));
        }
        Ok(())
    }

    /// `num_kv_heads` (where given) must equal the key/value head count the tensors have.
    pub fn check_kv_heads(&self, kv_heads: usize) -> Result<()> {
        if self.meta.contains_key("num_kv_heads") && self.meta_usize("num_kv_heads")? != kv_heads {
            let meta = self.meta_usize("num_kv_heads")?;
            return Err(fmt_err(&self.name, format!("num_kv_heads = {meta} but the tensors have {kv_heads}")));
        }
        Ok(())
    }

    /// A file's `block_pattern` (where it states one) must build exactly its `block_mask`
    /// for every batch and head, over the call's blocks (packed: the longest sequence's).
    fn check_block_pattern(&self) -> Result<()> {
        let Some(text) = self.meta.get("block_pattern") else { return Ok(()) };
        let mask = self.masks.block_mask().ok_or_else(|| fmt_err(&self.name, "block_pattern without block_mask"))?;
        let pattern = BlockPattern::parse(text).map_err(|e| fmt_err(&self.name, e))?;
        let (m, d) = (mask.view(), mask.view().dims());
        let one = BlockDims { batch: 1, heads: 1, ..d };
        let built = BlockMaskBuf::from_fn(one, m.block_size(), |_, _, i, j| pattern.keeps(i, j, d.k_blocks))
            .map_err(|e| fmt_err(&self.name, e))?;
        let b = built.view();
        let tiles = (0..d.batch).flat_map(|bi| (0..d.heads).map(move |h| (bi, h)));
        let tiles =
            tiles.flat_map(|(bi, h)| (0..d.q_blocks).flat_map(move |i| (0..d.k_blocks).map(move |j| (bi, h, i, j))));
        for (bi, h, i, j) in tiles {
            if m.keeps_blocks(bi, h, i, j) != b.keeps_blocks(0, 0, i, j) {
                return Err(fmt_err(
                    &self.name,
                    format!("block_mask differs from `{text}` at batch {bi}, head {h}, tile ({i}, {j})"),
                ));
            }
        }
        Ok(())
    }

    /// The file's key padding, packed sequences and block mask (none for files without them).
    pub fn masks(&self) -> Masks<'_> {
        self.masks.view()
    }
}

/// The repository's conformance vectors, `conformance/` (found from this crate's
/// manifest dir), or the directory named by `ATTN_GOLDEN_DIR`.
pub fn golden_dir() -> PathBuf {
    if let Ok(d) = std::env::var("ATTN_GOLDEN_DIR") {
        return PathBuf::from(d);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../conformance")
}

/// Every `*.safetensors` file in `dir` (sorted), each loaded or with its error. A
/// directory entry that cannot be read is an error, never silently dropped.
pub fn load_dir(dir: &Path) -> Result<Vec<(PathBuf, Result<GoldenCase>)>> {
    let dir_err = |e: std::io::Error| AttnError::Format(format!("{}: {e}", dir.display()));
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(dir_err)? {
        let path = entry.map_err(dir_err)?.path();
        if path.extension().is_some_and(|x| x == "safetensors") {
            paths.push(path);
        }
    }
    paths.sort();
    Ok(paths.into_iter().map(|p| (p.clone(), GoldenCase::load(&p))).collect())
}

/// The attention conformance directories of `conformance/` and their file counts
/// (`wide`: cross-attention with keys of their own length, explicit scales, head_dim 64
/// and 128).
pub const ATTENTION_DIRS: [(&str, usize); 3] = [("dilated", 9), ("features", 9), ("wide", 5)];

/// Every file of [`ATTENTION_DIRS`], loaded; panics naming a directory without its file
/// count or a file that does not load.
pub fn attention_cases() -> Vec<GoldenCase> {
    let mut out = Vec::new();
    for (dir, count) in ATTENTION_DIRS {
        let dir = golden_dir().join(dir);
        let cases = load_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        assert_eq!(cases.len(), count, "the {count} golden files in {}", dir.display());
        out.extend(cases.into_iter().map(|(path, case)| case.unwrap_or_else(|e| panic!("{}: {e}", path.display()))));
    }
    out
}

/// The block-mask conformance directory of `conformance/` and its file count.
pub const BLOCK_DIR: (&str, usize) = ("blocks", 8);

/// Every file of [`BLOCK_DIR`] through `backend`, each report printed: the failed (or
/// refused) reports; panics on a wrong file count or a file that does not load.
pub fn block_case_failures(backend: &dyn DilatedBackend) -> Vec<String> {
    let (name, count) = BLOCK_DIR;
    let dir = golden_dir().join(name);
    let cases = load_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert_eq!(cases.len(), count, "the {count} block-mask files in {}", dir.display());
    let mut failed = Vec::new();
    for (path, case) in cases {
        let case = case.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let report = check_case(&case, Some(backend), None);
        println!("{report}");
        if !report.passed() {
            failed.push(report.to_string());
        }
    }
    failed
}

/// Every file of [`BLOCK_DIR`] through `backend`; panics with the failed reports.
pub fn assert_block_dir_passes(backend: &dyn DilatedBackend) {
    let failed = block_case_failures(backend);
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}

/// Every file of [`ATTENTION_DIRS`] through `backend`, each report printed; panics with
/// the failed reports (or a wrong file count) after running them all.
pub fn assert_attention_dirs_pass(backend: &dyn DilatedBackend) {
    let mut failed = Vec::new();
    for case in attention_cases() {
        let report = check_case(&case, Some(backend), None);
        println!("{report}");
        if !report.passed() {
            failed.push(report.to_string());
        }
    }
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}
