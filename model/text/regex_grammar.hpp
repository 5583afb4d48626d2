#pragma once
// A JSON Schema `pattern` (an ECMA-262 regular expression) as a grammar
// expression (grammar.hpp's text form) over the *JSON-encoded* bytes of a
// string's content: what matches is what, once the string is decoded, the
// regex matches. The subset: literals and escapes (\d \w \s \D \W \S \. ...),
// `.`, classes of ASCII characters ([a-z_], [^...]; a negated class also takes
// any non-ASCII character), groups ( ) (?: ), `|`, * + ? {m} {m,} {m,n} (lazy
// forms too: the set of matches is the same), and ^ / $ at the ends (a side
// without its anchor takes any characters, as the regex matches anywhere).
// Backreferences, lookarounds, \b, named groups and flags are refused.
#include <string>
#include <string_view>

namespace strata::model {

/// `any_char`: the grammar expression for any one character of a JSON string
/// (encoded), used for unanchored ends and `.`'s non-ASCII part; `multibyte`:
/// one well-formed non-ASCII UTF-8 character. Throws Error(bad_argument)
/// "<path>: ..." naming what it cannot take.
std::string regex_grammar(std::string_view pattern, const std::string& any_char, const std::string& multibyte,
                          const std::string& path);

} // namespace strata::model
