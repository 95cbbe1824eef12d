//! `coded_enum!`: a fieldless enum whose variants travel as numeric codes
//! and have names (dtypes, reduce ops, collective kinds, failure causes),
//! written as one table: the enum, every variant in code order (`ALL`), the
//! name of each (`name`), the inverse of `as` (`from_code`) and, optionally,
//! one more per-variant value with an accessor of its own.

macro_rules! coded_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $Name:ident: $repr:ty {
            $($(#[$vmeta:meta])* $Variant:ident = $code:literal => $name:literal,)*
        }
        $(#[$name_meta:meta])*
        fn name;
    ) => {
        $(#[$meta])*
        #[repr($repr)]
        $vis enum $Name {
            $($(#[$vmeta])* $Variant = $code,)*
        }

        impl $Name {
            /// Every variant, in code order.
            pub const ALL: [$Name; [$(stringify!($Variant)),*].len()] = [$($Name::$Variant),*];

            $(#[$name_meta])*
            pub fn name(self) -> &'static str {
                match self {
                    $($Name::$Variant => $name,)*
                }
            }

            /// Inverse of `self as` its code type; `None` for an unknown code.
            pub fn from_code(code: $repr) -> Option<Self> {
                Self::ALL.into_iter().find(|v| *v as $repr == code)
            }
        }
    };
    (
        $(#[$meta:meta])*
        $vis:vis enum $Name:ident: $repr:ty {
            $($(#[$vmeta:meta])* $Variant:ident = $code:literal => $name:literal, $x:expr;)*
        }
        $(#[$name_meta:meta])*
        fn name;
        $(#[$x_meta:meta])*
        fn $x_fn:ident -> $x_ty:ty;
    ) => {
        coded_enum! {
            $(#[$meta])*
            $vis enum $Name: $repr {
                $($(#[$vmeta])* $Variant = $code => $name,)*
            }
            $(#[$name_meta])*
            fn name;
        }

        impl $Name {
            $(#[$x_meta])*
            pub fn $x_fn(self) -> $x_ty {
                match self {
                    $($Name::$Variant => $x,)*
                }
            }
        }
    };
}
