//! Element types and the bit-exact scalar conversions every ISA path must reproduce.
//!
//! The vector paths convert with integer arithmetic (bf16) or F16C (f16); the functions
//! here are the reference they are tested against and what the portable path uses.

use half::{bf16, f16};

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    Bf16,
    F16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// A storage element the kernels can load into and store from f32 lanes.
pub trait Elem: Copy + Send + Sync + 'static + sealed::Sealed {
    const DTYPE: DType;
    const ZERO: Self;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Elem for f32 {
    const DTYPE: DType = DType::F32;
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Elem for bf16 {
    const DTYPE: DType = DType::Bf16;
    const ZERO: Self = bf16::ZERO;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_bits(f32_to_bf16_bits(x))
    }
}

impl Elem for f16 {
    const DTYPE: DType = DType::F16;
    const ZERO: Self = f16::ZERO;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_bits(f32_to_f16_bits(x))
    }
}

/// The quiet NaN every NaN becomes in bf16 (PyTorch's and DeepSpeed's choice).
pub(crate) const BF16_NAN: u16 = 0x7FC0;

#[inline(always)]
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to bf16, round to nearest even; overflow goes to inf, NaN to `BF16_NAN`.
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if bits & 0x7FFF_FFFF > 0x7F80_0000 {
        return BF16_NAN;
    }
    let round = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// f16 to f32, exact; a signalling NaN is quieted as F16C does.
#[inline(always)]
pub fn f16_bits_to_f32(bits: u16) -> f32 {
    let sign = ((bits as u32) & 0x8000) << 16;
    let exp = ((bits >> 10) & 0x1F) as u32;
    let mant = (bits & 0x3FF) as u32;
    let magnitude = match exp {
        0 => {
            // Subnormal (or zero): mant * 2^-24 is exact in f32.
            let magnitude = mant as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -magnitude } else { magnitude };
        }
        0x1F if mant != 0 => 0x7FC0_0000 | (mant << 13),
        0x1F => 0x7F80_0000,
        _ => ((exp + 112) << 23) | (mant << 13),
    };
    f32::from_bits(sign | magnitude)
}

/// f32 to f16, IEEE round to nearest even (as F16C's `vcvtps2ph` with imm 0);
/// NaN keeps its sign and the top payload bits and is quieted.
#[inline(always)]
pub fn f32_to_f16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let abs = bits & 0x7FFF_FFFF;
    if abs > 0x7F80_0000 {
        return sign | 0x7E00 | ((abs >> 13) & 0x3FF) as u16;
    }
    if abs >= 0x4780_0000 {
        // |x| >= 65536 (or inf): beyond the rounding range of the largest finite f16.
        return sign | 0x7C00;
    }
    if abs >= 0x3880_0000 {
        // Normal f16 range: rebias the exponent, round the 13 dropped bits to nearest even.
        let h = (abs >> 13) - (112 << 10);
        let dropped = abs & 0x1FFF;
        let up = dropped > 0x1000 || (dropped == 0x1000 && h & 1 == 1);
        return sign | (h + up as u32) as u16;
    }
    if abs <= 0x3300_0000 {
        // |x| <= 2^-25 rounds to zero (the tie at 2^-25 goes to the even zero).
        return sign;
    }
    // Subnormal f16: the value in units of 2^-24, rounded to nearest even.
    let exp = abs >> 23;
    let mant = (abs & 0x7F_FFFF) | 0x80_0000;
    let shift = 126 - exp;
    let h = mant >> shift;
    let dropped = mant & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    let up = dropped > half || (dropped == half && h & 1 == 1);
    sign | (h + up as u32) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_and_rounding() {
        for bits in 0..=u16::MAX {
            let x = bf16_bits_to_f32(bits);
            let back = f32_to_bf16_bits(x);
            if x.is_nan() {
                assert_eq!(back, BF16_NAN);
            } else {
                assert_eq!(back, bits, "bf16 {bits:#06x}");
            }
        }
        // Ties go to even, above-tie rounds up, overflow to inf.
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3F80_8000)), 0x3F80);
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3F81_8000)), 0x3F82);
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert_eq!(f32_to_bf16_bits(f32::MAX), 0x7F80);
        assert_eq!(f32_to_bf16_bits(f32::NEG_INFINITY), 0xFF80);
    }

    #[test]
    fn f16_matches_half_crate_on_non_nan() {
        for bits in 0..=u16::MAX {
            let ours = f16_bits_to_f32(bits);
            let theirs = f16::from_bits(bits).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan());
                assert_eq!(f32_to_f16_bits(ours) & 0x7E00, 0x7E00, "quiet NaN stays NaN");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "f16 {bits:#06x}");
                assert_eq!(f32_to_f16_bits(ours), bits);
            }
        }
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..2_000_000 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let x = f32::from_bits((state >> 32) as u32);
            if x.is_nan() {
                continue;
            }
            assert_eq!(f32_to_f16_bits(x), f16::from_f32(x).to_bits(), "f32 {:#010x}", x.to_bits());
        }
    }
}
