//! One attention head's products on the convolution's direct tiles, with
//! the causal structure skipped: S = q·kᵀ and dP = dO·vᵀ only for the
//! column tiles a block of rows can see, o = P·v and dq = dS·k only over
//! the keys a block sees, dk = dSᵀ·q and dv = Pᵀ·dO only over the queries
//! that see a block. About half the arithmetic of the full products, and
//! none of the `gemm` crate's packing, which cost more than the products
//! at T = 64, d = 32 (a head ran at about 40 GFLOP/s a core through it).
//!
//! Every output is one chain of FMAs in order, so the bits do not depend
//! on the vector width; the terms skipped are exact zeros of P and dS
//! (the future), which add nothing. q, k, v and dO are read in place
//! (rows of the projections' outputs); kᵀ and vᵀ are copied per head
//! (T·d floats each) so that the tiles read contiguous columns.
//!
//! Taken where T and d are multiples of 16 and the CPU has AVX2+FMA
//! (`supported`); `attention.rs` keeps the `gemm` path for the rest.

use std::ops::Range;

use crate::ops::conv::cpu::direct_tiles::{self as direct, Init, Steps};

/// More than the rows of any tile (12 with AVX-512, 6 with AVX2).
const MAX_TILE_ROWS: usize = 16;

/// Whether a head of length `t` and width `d` runs on the tiles here.
pub(super) fn supported(t: usize, d: usize) -> bool {
    t > 0 && d > 0 && direct::supports(t) && direct::supports(d)
}

/// One head's operands read in place: q, k, v [T, d] with rows `stride`
/// floats apart; `supported(t, d)` holds.
pub(super) struct TiledHead<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub stride: usize,
    pub t: usize,
    pub d: usize,
}

/// A left operand read in place: element (r, i) at data[r·row + i·step].
#[derive(Clone, Copy)]
struct Lhs<'a> {
    data: &'a [f32],
    row: usize,
    step: usize,
}

/// A right operand with contiguous rows `row` floats apart.
#[derive(Clone, Copy)]
struct Rhs<'a> {
    data: &'a [f32],
    row: usize,
}

impl TiledHead<'_> {
    fn rows<'b>(&self, data: &'b [f32]) -> Lhs<'b> {
        Lhs {
            data,
            row: self.stride,
            step: 1,
        }
    }

    /// S = q·kᵀ into `s` [T, T], the visible column tiles of each row
    /// block (the rest is left for the softmax to zero).
    pub fn scores(&self, s: &mut [f32]) {
        let (t, d) = (self.t, self.d);
        let k_t = transpose(self.k, t, d, self.stride);
        let rhs = Rhs { data: &k_t, row: t };
        product(s, t, t, self.rows(self.q), rhs, |_, _| 0..d, true);
    }

    /// o = P·v into `o` [T, d]: keys up to the block's last row.
    pub fn output(&self, p: &[f32], o: &mut [f32]) {
        let (t, d) = (self.t, self.d);
        let lhs = Lhs {
            data: p,
            row: t,
            step: 1,
        };
        let rhs = Rhs {
            data: self.v,
            row: self.stride,
        };
        product(o, t, d, lhs, rhs, |_, end| 0..end, false);
    }

    /// dP = dO·vᵀ into `dp` [T, T], the visible column tiles; dO's rows
    /// are `d_out_stride` floats apart.
    pub fn d_probabilities(&self, (d_out, d_out_stride): (&[f32], usize), dp: &mut [f32]) {
        let (t, d) = (self.t, self.d);
        let v_t = transpose(self.v, t, d, self.stride);
        let lhs = Lhs {
            data: d_out,
            row: d_out_stride,
            step: 1,
        };
        let rhs = Rhs { data: &v_t, row: t };
        product(dp, t, t, lhs, rhs, |_, _| 0..d, true);
    }

    /// dq = dS·k, dk = dSᵀ·q and dv = Pᵀ·dO into [T, d] blocks.
    pub fn gradients(
        &self,
        p: &[f32],
        ds: &[f32],
        (d_out, d_out_stride): (&[f32], usize),
        grads: [&mut [f32]; 3],
    ) {
        let (t, d) = (self.t, self.d);
        let [dq, dk, dv] = grads;
        let rows = |data| Lhs {
            data,
            row: t,
            step: 1,
        };
        let columns = |data| Lhs {
            data,
            row: 1,
            step: t,
        };
        let rhs = |data, row| Rhs { data, row };
        let stride = self.stride;
        product(
            dq,
            t,
            d,
            rows(ds),
            rhs(self.k, stride),
            |_, end| 0..end,
            false,
        );
        // Key j is seen by queries j..T.
        let seen_by = |start, _| start..t;
        product(dk, t, d, columns(ds), rhs(self.q, stride), seen_by, false);
        product(
            dv,
            t,
            d,
            columns(p),
            rhs(d_out, d_out_stride),
            seen_by,
            false,
        );
    }
}

/// The [rows × cols] matrix with rows `stride` floats apart, transposed
/// into a contiguous [cols × rows].
fn transpose(m: &[f32], rows: usize, cols: usize, stride: usize) -> Vec<f32> {
    let mut out = vec![0.0; rows * cols];
    for i in 0..rows {
        for (j, &value) in m[i * stride..][..cols].iter().enumerate() {
            out[j * rows + i] = value;
        }
    }
    out
}

/// dst [m × n] (rows n apart): row r = Σ_{i ∈ reach(start, end)} lhs(r, i)
/// · rhs row i, for each block of one tile's rows [start, end). With
/// `causal_columns`, a block writes only the column tiles up to its last
/// row (the columns past it are the future).
fn product(
    dst: &mut [f32],
    m: usize,
    n: usize,
    lhs: Lhs,
    rhs: Rhs,
    reach: impl Fn(usize, usize) -> Range<usize>,
    causal_columns: bool,
) {
    assert!(dst.len() >= m * n, "tiled head: dst too small");
    let width = direct::tile_width(n);
    let block = direct::tile_rows(width);
    let mut rows = [(0usize, 0usize); MAX_TILE_ROWS];
    for start in (0..m).step_by(block) {
        let end = (start + block).min(m);
        let span = reach(start, end);
        if let Some(last) = span.clone().last() {
            let lhs_last = (end - 1) * lhs.row + last * lhs.step;
            assert!(lhs_last < lhs.data.len(), "tiled head: lhs too small");
            assert!(
                last * rhs.row + n <= rhs.data.len(),
                "tiled head: rhs too small"
            );
        }
        let columns = match causal_columns {
            true => end.next_multiple_of(width).min(n),
            false => n,
        };
        for col in (0..columns).step_by(width) {
            let tile = &mut rows[..end - start];
            for (slot, r) in tile.iter_mut().zip(start..end) {
                *slot = (r * lhs.row, r * n + col);
            }
            let segs = [(
                (span.start * lhs.step) as isize,
                (span.start * rhs.row + col) as isize,
            )];
            let walk = Steps {
                segs: &segs,
                len: span.len(),
                a_step: lhs.step as isize,
                b_step: rhs.row as isize,
            };
            // SAFETY: `supported` held for the head, so N is a multiple of
            // 16 (and of 32 where `width` is); row r reads lhs at r·row +
            // i·step and rhs at i·row + col..+width for i in the reach,
            // inside both (the asserts above); it writes dst[r·n + col..]
            // [..width], inside dst (r < m, col + width ≤ n) and its own,
            // and dst aliases neither operand (it is borrowed mutably).
            unsafe {
                direct::tiles(
                    tile,
                    lhs.data,
                    rhs.data,
                    &walk,
                    width,
                    dst.as_mut_ptr(),
                    dst.len(),
                    Init::Zero,
                );
            }
        }
    }
}
