//! A base weight matrix as the checkpoint stores it, and the matrix products
//! that read it.
//!
//! Design: a bf16 or f16 tensor stays in its dtype. Its bytes are read
//! straight from a memory mapping of that tensor's own range of the file (no
//! copy is made: the pages are the file's, resident once read, and the
//! mapping goes when the weight does); GPT-2's fused `c_attn` split into q,
//! k and v is the one exception, copied once in its dtype. An f32 tensor is
//! one f32 copy, as before. Nothing is converted at load.
//!
//! A product with a half-precision weight converts it to f32 panel by panel
//! into a scratch buffer the calling thread keeps, and runs the same gemm
//! call on each panel as on the whole converted matrix. Panels split the
//! weight's free dimension only (the output's rows or columns it makes,
//! never the sum), and each panel is wide enough that the gemm crate takes
//! the same path as on the whole matrix (not its small-matrix, horizontal
//! or matrix-vector kernels unless the whole product would), whose blocking
//! of the sum depends on the sum's length alone. bf16 and f16 convert to
//! f32 exactly, so the result is the same bits as converting the whole
//! weight at load (the tests below check it across panel splits).
//!
//! Memory: the weight at its stored size; one scratch per thread that
//! starts products (a pass: its own thread; rayon's threads only fill it)
//! of at most [`PANEL_VALUES`] f32s (16 MiB), or of a minimum panel's width
//! times the sum's length when that is more (the head's input gradient on
//! Llama-3.2-1B's 128,256-row vocabulary: panels of 128 of its 2,048
//! columns, 63 MiB), kept after first use, sized by [`scratch_values`]. An
//! f32 weight needs no scratch.

use std::cell::RefCell;
use std::sync::Arc;

use memmap2::Mmap;
use rayon::prelude::*;

use crate::math::{gemm_views, parallelism, View};

/// The most f32s a product converts at once (16 MiB): the scratch a panel
/// fills, unless a minimum-width panel needs more.
pub const PANEL_VALUES: usize = 1 << 22;

/// The fewest values of the free dimension a panel keeps when the product
/// could take the gemm crate's horizontal kernel (m · n ≤ 256 with both
/// operands' sums contiguous): 257 keeps m · n above 256 for any n.
const MIN_PANEL_HORIZONTAL: usize = 257;

/// Otherwise the fewest: 65 keeps the panel off the crate's small-matrix
/// blocking (both m and n ≤ 64), and off its matrix-vector kernels (m or
/// n ≤ 1), which a wider whole product would not take.
const MIN_PANEL: usize = 65;

/// Below this many values a conversion runs on the calling thread, and no
/// task of a parallel one converts fewer (about 0.1 ms of work: fewer
/// hand-overs to idle threads).
const PARALLEL_CONVERSION: usize = 1 << 18;

/// The dtype a weight is held in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    Bf16,
    F16,
}

impl WeightDtype {
    /// safetensors' spelling.
    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "F32",
            WeightDtype::Bf16 => "BF16",
            WeightDtype::F16 => "F16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::Bf16 | WeightDtype::F16 => 2,
        }
    }
}

/// A half-precision tensor's little-endian bytes.
#[derive(Clone)]
enum Bytes {
    /// `len` bytes from `start` of a mapping of (a page-aligned range
    /// around) the tensor.
    Mapped {
        map: Arc<Mmap>,
        start: usize,
        len: usize,
    },
    Owned(Arc<Vec<u8>>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, start, len } => &map[*start..*start + *len],
            Bytes::Owned(bytes) => bytes,
        }
    }
}

#[derive(Clone)]
enum Store {
    F32(Vec<f32>),
    /// bf16 or f16 (never `WeightDtype::F32`).
    Half {
        dtype: WeightDtype,
        bytes: Bytes,
    },
}

/// A row-major [rows, cols] matrix as the checkpoint stores it (a Linear's
/// [out, in], a Conv1D's [in, out], an embedding's [vocab, hidden]), in
/// f32, bf16 or f16. Two weights are equal when they have the same shape
/// and the same values as f32, whatever they are stored in.
#[derive(Clone)]
pub struct Weight {
    rows: usize,
    cols: usize,
    store: Store,
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Weight {{ {} × {}, {} }}",
            self.rows,
            self.cols,
            self.dtype().name()
        )
    }
}

impl PartialEq for Weight {
    fn eq(&self, other: &Self) -> bool {
        if (self.rows, self.cols) != (other.rows, other.cols) {
            return false;
        }
        match (self.as_f32(), other.as_f32()) {
            (Some(a), Some(b)) => a == b,
            _ => self.to_f32() == other.to_f32(),
        }
    }
}

/// `src` (little-endian bf16 or f16) into `dst`, one value per 2 bytes.
fn convert_run(dtype: WeightDtype, src: &[u8], dst: &mut [f32]) {
    match dtype {
        // bf16 is the top half of an f32: the shift is exact.
        WeightDtype::Bf16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
            }
        }
        WeightDtype::F16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        // Never stored as half bytes.
        WeightDtype::F32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
}

impl Weight {
    /// An f32 weight; `data` must hold rows · cols values.
    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), rows * cols, "Weight::from_f32: not rows × cols");
        Self {
            rows,
            cols,
            store: Store::F32(data),
        }
    }

    /// A bf16 or f16 weight over `len` bytes from `start` of `map`.
    pub(crate) fn from_mapped(
        rows: usize,
        cols: usize,
        dtype: WeightDtype,
        map: Mmap,
        start: usize,
    ) -> Self {
        let len = rows * cols * dtype.size();
        assert!(
            dtype != WeightDtype::F32 && start + len <= map.len(),
            "Weight::from_mapped: a half-precision range inside the mapping"
        );
        Self {
            rows,
            cols,
            store: Store::Half {
                dtype,
                bytes: Bytes::Mapped {
                    map: Arc::new(map),
                    start,
                    len,
                },
            },
        }
    }

    /// A bf16 or f16 weight owning its little-endian bytes.
    pub fn from_half_bytes(rows: usize, cols: usize, dtype: WeightDtype, bytes: Vec<u8>) -> Self {
        assert!(
            dtype != WeightDtype::F32 && bytes.len() == rows * cols * dtype.size(),
            "Weight::from_half_bytes: rows × cols half-precision values"
        );
        Self {
            rows,
            cols,
            store: Store::Half {
                dtype,
                bytes: Bytes::Owned(Arc::new(bytes)),
            },
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// rows · cols.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> WeightDtype {
        match &self.store {
            Store::F32(_) => WeightDtype::F32,
            Store::Half { dtype, .. } => *dtype,
        }
    }

    /// The bytes the values take as held (the mapped pages, once read,
    /// for a weight read from the file).
    pub fn stored_bytes(&self) -> usize {
        self.len() * self.dtype().size()
    }

    /// The values, if held in f32.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.store {
            Store::F32(data) => Some(data),
            Store::Half { .. } => None,
        }
    }

    /// Every value as f32, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.store {
            Store::F32(data) => data.clone(),
            Store::Half { .. } => {
                let mut out = vec![0.0f32; self.len()];
                self.convert_block(0, self.rows, 0, self.cols, &mut out);
                out
            }
        }
    }

    /// The values as f32 to change in place: a half-precision weight is
    /// converted to f32 first and held so from then on (its mapping or
    /// bytes are let go), as merging adapters in memory and a full
    /// fine-tune's updates need.
    pub fn f32_mut(&mut self) -> &mut [f32] {
        if let Store::Half { .. } = self.store {
            let data = self.to_f32();
            self.store = Store::F32(data);
        }
        match &mut self.store {
            Store::F32(data) => data,
            Store::Half { .. } => &mut [],
        }
    }

    /// Row `row` as f32 into `dst` (cols values): an embedding's lookup.
    pub fn copy_row(&self, row: usize, dst: &mut [f32]) {
        let c = self.cols;
        match &self.store {
            Store::F32(data) => dst.copy_from_slice(&data[row * c..(row + 1) * c]),
            Store::Half { dtype, bytes } => {
                assert_eq!(dst.len(), c, "Weight::copy_row: dst is not one row");
                let s = dtype.size();
                convert_run(
                    *dtype,
                    &bytes.as_slice()[row * c * s..(row + 1) * c * s],
                    dst,
                );
            }
        }
    }

    /// Columns `first..first + width` of every row, as a [rows, width]
    /// weight in the same dtype (GPT-2's q, k and v thirds of `c_attn`).
    pub(crate) fn columns(&self, first: usize, width: usize) -> Weight {
        assert!(
            first + width <= self.cols,
            "Weight::columns: past the last column"
        );
        match &self.store {
            Store::F32(data) => {
                let mut part = Vec::with_capacity(self.rows * width);
                for row in data.chunks_exact(self.cols.max(1)) {
                    part.extend_from_slice(&row[first..first + width]);
                }
                Weight::from_f32(self.rows, width, part)
            }
            Store::Half { dtype, bytes } => {
                let s = dtype.size();
                let mut part = Vec::with_capacity(self.rows * width * s);
                for row in bytes.as_slice().chunks_exact((self.cols * s).max(1)) {
                    part.extend_from_slice(&row[first * s..(first + width) * s]);
                }
                Weight::from_half_bytes(self.rows, width, *dtype, part)
            }
        }
    }

    /// The block of rows `row0..row0 + nrows` and columns `col0..col0 +
    /// ncols` as f32 into `dst`, row-major [nrows, ncols]; rows in parallel
    /// when the block is large (each value is converted on its own, so the
    /// result is the same whatever the threads).
    fn convert_block(&self, row0: usize, nrows: usize, col0: usize, ncols: usize, dst: &mut [f32]) {
        let dst = &mut dst[..nrows * ncols];
        if ncols == 0 || nrows == 0 {
            return;
        }
        match &self.store {
            Store::F32(data) => {
                for (r, out) in dst.chunks_exact_mut(ncols).enumerate() {
                    let from = (row0 + r) * self.cols + col0;
                    out.copy_from_slice(&data[from..from + ncols]);
                }
            }
            Store::Half { dtype, bytes } => {
                let (dtype, src, s, cols) = (*dtype, bytes.as_slice(), dtype.size(), self.cols);
                let row = |(r, out): (usize, &mut [f32])| {
                    let from = ((row0 + r) * cols + col0) * s;
                    convert_run(dtype, &src[from..from + ncols * s], out);
                };
                if nrows * ncols >= PARALLEL_CONVERSION {
                    let rows_per_task = (PARALLEL_CONVERSION / ncols).max(1);
                    dst.par_chunks_mut(ncols)
                        .with_min_len(rows_per_task)
                        .enumerate()
                        .for_each(row);
                } else {
                    dst.chunks_exact_mut(ncols).enumerate().for_each(row);
                }
            }
        }
    }

    /// The weight as a product's operand, as stored.
    pub(crate) fn operand(&self) -> Operand<'_> {
        Operand {
            weight: self,
            transposed: false,
        }
    }
}

/// A weight as one side of a matrix product: the stored [rows, cols]
/// matrix, or its transpose.
#[derive(Clone, Copy)]
pub(crate) struct Operand<'a> {
    weight: &'a Weight,
    transposed: bool,
}

impl Operand<'_> {
    pub(crate) fn t(self) -> Self {
        Self {
            transposed: !self.transposed,
            ..self
        }
    }

    fn rows(&self) -> usize {
        if self.transposed {
            self.weight.cols
        } else {
            self.weight.rows
        }
    }

    fn cols(&self) -> usize {
        if self.transposed {
            self.weight.rows
        } else {
            self.weight.cols
        }
    }

    /// The operand over a row-major [rows, cols] f32 copy of (part of) the
    /// stored matrix: the same orientation, so the same unit strides.
    fn over<'b>(&self, data: &'b [f32], rows: usize, cols: usize) -> View<'b> {
        let stored = View::new(data, rows, cols);
        if self.transposed {
            stored.t()
        } else {
            stored
        }
    }
}

/// How many values of a product's free dimension (`free` long, each a run
/// of `reduce` values of the weight) one panel converts: all of them when
/// they fit in `budget` f32s ([`PANEL_VALUES`]), else an even split into panels of at least
/// `min` (a split into `count` panels of `free / count` rounded either
/// way). Returns (panel count, the longest panel).
fn panels(free: usize, reduce: usize, min: usize, budget: usize) -> (usize, usize) {
    if free * reduce <= budget {
        return (1, free);
    }
    // At least 2 · min, so that halves rounded down still reach min.
    let most = (budget / reduce.max(1)).max(2 * min);
    if free <= most {
        return (1, free);
    }
    let count = free.div_ceil(most);
    (count, free.div_ceil(count))
}

/// The most f32s a product with `weight` converts at once (0 for an f32
/// weight): the larger of its two orientations' panels. Panels of rows may
/// need the horizontal kernel's minimum (their sums run along the stored
/// rows, contiguous); panels of columns never do (their sums are strided).
pub fn scratch_values(weight: &Weight) -> usize {
    if weight.dtype() == WeightDtype::F32 {
        return 0;
    }
    let (r, c) = (weight.rows, weight.cols);
    let along_rows = panels(r, c, MIN_PANEL_HORIZONTAL, PANEL_VALUES).1 * c;
    let along_cols = panels(c, r, MIN_PANEL, PANEL_VALUES).1 * r;
    along_rows.max(along_cols)
}

thread_local! {
    /// The calling thread's conversion scratch, kept between products.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `f` on `len` f32s of this thread's scratch, or of a fresh buffer when
/// the scratch is in use (a product started from a task this thread took
/// on while it waited inside another).
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < len {
                // Let the old one go first: never both at once.
                *buf = Vec::new();
                *buf = vec![0.0f32; len];
            }
            f(&mut buf[..len])
        }
        Err(_) => f(&mut vec![0.0f32; len]),
    })
}

/// Which side of the product the weight is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Lhs,
    Rhs,
}

impl Side {
    /// (left, right) of the product of the weight's view and the other.
    fn order<'x>(self, weight: View<'x>, other: View<'x>) -> (View<'x>, View<'x>) {
        match self {
            Side::Lhs => (weight, other),
            Side::Rhs => (other, weight),
        }
    }
}

/// dst = w · b (or += with `accumulate`), element (i, j) of dst at
/// i · `dst_rs` + j · `dst_cs`; `parallel` as [`crate::math::gemm_strided`].
pub(crate) fn gemm_weight_lhs(
    dst: &mut [f32],
    dst_rs: usize,
    dst_cs: usize,
    w: Operand,
    b: View,
    accumulate: bool,
    parallel: bool,
) {
    let budget = PANEL_VALUES;
    gemm_weight(
        dst,
        dst_rs,
        dst_cs,
        w,
        Side::Lhs,
        b,
        accumulate,
        parallel,
        budget,
    );
}

/// dst = a · w (or += with `accumulate`), as [`gemm_weight_lhs`].
pub(crate) fn gemm_weight_rhs(
    dst: &mut [f32],
    dst_rs: usize,
    dst_cs: usize,
    a: View,
    w: Operand,
    accumulate: bool,
    parallel: bool,
) {
    let budget = PANEL_VALUES;
    gemm_weight(
        dst,
        dst_rs,
        dst_cs,
        w,
        Side::Rhs,
        a,
        accumulate,
        parallel,
        budget,
    );
}

#[allow(clippy::too_many_arguments)]
fn gemm_weight(
    dst: &mut [f32],
    dst_rs: usize,
    dst_cs: usize,
    w: Operand,
    side: Side,
    other: View,
    accumulate: bool,
    parallel: bool,
    budget: usize,
) {
    let (m, k, n) = match side {
        Side::Lhs => (w.rows(), w.cols(), other.cols),
        Side::Rhs => (other.rows, other.cols, w.cols()),
    };
    // One decision for the whole product, as on the whole matrix.
    let threads = parallelism(parallel, m, n, k);
    let weight = w.weight;
    let (rows, cols) = (weight.rows, weight.cols);
    if let Store::F32(data) = &weight.store {
        let (a, b) = side.order(w.over(data, rows, cols), other);
        gemm_views(dst, dst_rs, dst_cs, a, b, accumulate, threads);
        return;
    }
    // The weight's free dimension (m as the left side, n as the right)
    // runs along its stored rows or its stored columns.
    let along_rows = (side == Side::Lhs) != w.transposed;
    let (free, reduce) = if along_rows {
        (rows, cols)
    } else {
        (cols, rows)
    };
    // gemm's horizontal kernel needs the left side's sum and the right
    // side's sum contiguous (unit column stride on the left, unit row
    // stride on the right); a panel keeps the whole operand's unit strides.
    let stored_cs = 1;
    let (w_rs, w_cs) = if w.transposed {
        (stored_cs, cols)
    } else {
        (cols, stored_cs)
    };
    let horizontal = match side {
        Side::Lhs => w_cs == 1 && other.rs == 1,
        Side::Rhs => other.cs == 1 && w_rs == 1,
    };
    let min = if horizontal {
        MIN_PANEL_HORIZONTAL
    } else {
        MIN_PANEL
    };
    let (count, longest) = panels(free, reduce, min, budget);
    with_scratch(longest * reduce, |scratch| {
        for p in 0..count {
            let (from, to) = (p * free / count, (p + 1) * free / count);
            let width = to - from;
            let wv = if along_rows {
                weight.convert_block(from, width, 0, cols, scratch);
                w.over(&scratch[..width * cols], width, cols)
            } else {
                weight.convert_block(0, rows, from, width, scratch);
                w.over(&scratch[..rows * width], rows, width)
            };
            // The panel writes dst's rows (left side) or columns (right
            // side) from `from` on.
            let offset = match side {
                Side::Lhs => from * dst_rs,
                Side::Rhs => from * dst_cs,
            };
            let (a, b) = side.order(wv, other);
            gemm_views(
                &mut dst[offset..],
                dst_rs,
                dst_cs,
                a,
                b,
                accumulate,
                threads,
            );
        }
    });
}

/// y[n, out] = x[n, in] · W (+ bias), W laid out as `layout` says: the
/// projection of [`crate::math::project`] on a weight held in any dtype.
pub fn project(
    x: &[f32],
    n: usize,
    w: &Weight,
    layout: crate::math::Layout,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let (inp, out) = match layout {
        crate::math::Layout::OutIn => (w.cols, w.rows),
        crate::math::Layout::InOut => (w.rows, w.cols),
    };
    if let Some(data) = w.as_f32() {
        return crate::math::project(x, n, data, inp, out, layout, bias);
    }
    assert_eq!(x.len(), n * inp, "project: input is not n × in");
    let mut y = vec![0.0f32; n * out];
    if n == 0 || out == 0 {
        return y;
    }
    if inp > 0 {
        let op = match layout {
            crate::math::Layout::OutIn => w.operand().t(),
            crate::math::Layout::InOut => w.operand(),
        };
        gemm_weight_rhs(&mut y, out, 1, View::new(x, n, inp), op, false, true);
    }
    if let Some(bias) = bias {
        for row in y.chunks_exact_mut(out) {
            for (v, b) in row.iter_mut().zip(bias) {
                *v += b;
            }
        }
    }
    y
}

/// op(x) · op(w) as a fresh [m, n] (the weight on the right): x [m, k]
/// (stored [k, m] when `tx`), w's operand [k, n].
pub(crate) fn matmul_weight(x: &[f32], m: usize, k: usize, tx: bool, w: Operand) -> Vec<f32> {
    let n = w.cols();
    let a = if tx {
        View::new(x, k, m).t()
    } else {
        View::new(x, m, k)
    };
    let mut c = vec![0.0f32; m * n];
    gemm_weight_rhs(&mut c, n, 1, a, w, false, true);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panels_split_evenly_and_never_below_the_minimum() {
        assert_eq!(panels(300, 64, MIN_PANEL, PANEL_VALUES), (1, 300));
        for (free, reduce, min) in [
            (128_256, 2048, MIN_PANEL_HORIZONTAL),
            (2048, 128_256, MIN_PANEL),
            (8192, 2048, MIN_PANEL),
            (1000, 1 << 20, MIN_PANEL_HORIZONTAL),
            (515, 1 << 20, MIN_PANEL_HORIZONTAL),
        ] {
            let (count, longest) = panels(free, reduce, min, PANEL_VALUES);
            assert!(count >= 1);
            for p in 0..count {
                let width = (p + 1) * free / count - p * free / count;
                assert!(width <= longest, "{free}/{count}: {width} > {longest}");
                assert!(
                    count == 1 || width >= min,
                    "{free} split {count} ways: a panel of {width} < {min}"
                );
            }
            assert!(
                count == 1 || longest * reduce <= PANEL_VALUES || longest <= 2 * min,
                "{free} × {reduce}: panels of {longest}"
            );
        }
    }

    #[test]
    fn half_weights_read_as_their_f32_values() {
        let values = [1.5f32, -2.0, 0.15625, 3.0e-3, 65504.0, -0.0];
        for dtype in [WeightDtype::Bf16, WeightDtype::F16] {
            let bytes: Vec<u8> = values
                .iter()
                .flat_map(|&v| match dtype {
                    WeightDtype::Bf16 => half::bf16::from_f32(v).to_le_bytes(),
                    _ => half::f16::from_f32(v).to_le_bytes(),
                })
                .collect();
            let expected: Vec<f32> = values
                .iter()
                .map(|&v| match dtype {
                    WeightDtype::Bf16 => half::bf16::from_f32(v).to_f32(),
                    _ => half::f16::from_f32(v).to_f32(),
                })
                .collect();
            let w = Weight::from_half_bytes(2, 3, dtype, bytes);
            assert_eq!(w.to_f32(), expected, "{dtype:?}");
            let mut row = [0.0f32; 3];
            w.copy_row(1, &mut row);
            assert_eq!(&row[..], &expected[3..], "{dtype:?}");
            let third = w.columns(1, 1);
            assert_eq!(third.to_f32(), vec![expected[1], expected[4]]);
            let mut owned = w.clone();
            owned.f32_mut()[0] = 7.0;
            assert_eq!(owned.dtype(), WeightDtype::F32);
            assert_eq!(owned.to_f32()[1..], expected[1..]);
            assert_ne!(owned, w);
        }
    }

    /// A [rows, cols] bf16 weight of seeded values and its f32 twin (what
    /// converting at load made).
    fn twins(rows: usize, cols: usize, seed: u64) -> (Weight, Weight) {
        let mut state = seed;
        let bytes: Vec<u8> = (0..rows * cols)
            .flat_map(|_| {
                let z = crate::math::splitmix64(&mut state);
                let v = (z >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                half::bf16::from_f32(v).to_le_bytes()
            })
            .collect();
        let half = Weight::from_half_bytes(rows, cols, WeightDtype::Bf16, bytes);
        let f32 = Weight::from_f32(rows, cols, half.to_f32());
        (half, f32)
    }

    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..len)
            .map(|_| (crate::math::splitmix64(&mut state) >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect()
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// Split into panels (a budget of one value forces the fewest-wide
    /// panels the rules allow), every orientation, side and destination
    /// layout gives the bits of the product on the whole f32 matrix, also
    /// with the other side only 1, 2, 3, 64 or 65 wide (where the gemm
    /// crate has its other kernels) and sums longer than its 512-value
    /// blocking.
    #[test]
    fn panels_give_the_whole_f32_products_bits() {
        let (rows, cols) = (1100, 600);
        let (half, f32) = twins(rows, cols, 5);
        let mut split_seen = 0;
        for transposed in [false, true] {
            for side in [Side::Lhs, Side::Rhs] {
                let (op_h, op_f) = if transposed {
                    (half.operand().t(), f32.operand().t())
                } else {
                    (half.operand(), f32.operand())
                };
                let (wr, wc) = (op_h.rows(), op_h.cols());
                for other in [1usize, 2, 3, 64, 65, 100] {
                    // The other side, [other-wide], row-major or as a
                    // transposed view (unit row stride).
                    for other_t in [false, true] {
                        let (m, k, n) = match side {
                            Side::Lhs => (wr, wc, other),
                            Side::Rhs => (other, wr, wc),
                        };
                        let (or, oc) = match side {
                            Side::Lhs => (k, n),
                            Side::Rhs => (m, k),
                        };
                        let data = values(or * oc, (m * 31 + n) as u64);
                        let view = if other_t {
                            View::new(&data, oc, or).t()
                        } else {
                            View::new(&data, or, oc)
                        };
                        for (dst_rs, dst_cs) in [(n, 1), (1, m)] {
                            for accumulate in [false, true] {
                                let start = values(m * n, 9);
                                let run = |op: Operand, budget: usize| {
                                    let mut dst = start.clone();
                                    gemm_weight(
                                        &mut dst, dst_rs, dst_cs, op, side, view, accumulate, true,
                                        budget,
                                    );
                                    dst
                                };
                                let whole = run(op_f, usize::MAX);
                                let split = run(op_h, 1);
                                let one_panel = run(op_h, usize::MAX);
                                let differ = |x: &[f32]| {
                                    bits(x)
                                        .iter()
                                        .zip(bits(&whole))
                                        .filter(|(a, b)| *a != b)
                                        .count()
                                };
                                assert_eq!(
                                    (differ(&split), differ(&one_panel)),
                                    (0, 0),
                                    "values differing from the f32 product's (in panels, in one) with \
                                     transposed {transposed}, {}, other {other} (t {other_t}), \
                                     dst ({dst_rs}, {dst_cs}), accumulate {accumulate}",
                                    if side == Side::Lhs { "left" } else { "right" }
                                );
                            }
                        }
                    }
                }
                let along_rows = (side == Side::Lhs) != transposed;
                let (free, reduce) = if along_rows {
                    (rows, cols)
                } else {
                    (cols, rows)
                };
                if panels(free, reduce, MIN_PANEL, 1).0 > 1 {
                    split_seen += 1;
                }
            }
        }
        assert_eq!(split_seen, 4, "every orientation was split into panels");
    }

    /// `project` on a bf16 weight equals it on the f32 copy, both layouts,
    /// with a bias, one row (generation) and many.
    #[test]
    fn project_on_half_equals_project_on_f32() {
        let (half, f32) = twins(300, 200, 8);
        for layout in [crate::math::Layout::OutIn, crate::math::Layout::InOut] {
            let (inp, out) = match layout {
                crate::math::Layout::OutIn => (200, 300),
                crate::math::Layout::InOut => (300, 200),
            };
            let bias = values(out, 3);
            for n in [1usize, 7, 130] {
                let x = values(n * inp, n as u64);
                let a = project(&x, n, &half, layout, Some(&bias));
                let b = project(&x, n, &f32, layout, Some(&bias));
                assert_eq!(bits(&a), bits(&b), "{layout:?}, n {n}");
            }
        }
    }
}
