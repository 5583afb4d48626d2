// The interpreter of the template engine: scopes, statements, operators,
// attribute and item access, loops and macros. Filters, tests and methods are
// in jinja_builtins.cpp.

#include "model/text/jinja/jinja.hpp"
#include "model/text/jinja/ast.hpp"
#include "model/text/jinja/builtins.hpp"

#include <cmath>
#include <ctime>
#include <optional>
#include <unordered_map>

namespace strata::model::jinja {

namespace {

constexpr int64_t max_range = 1 << 20;

enum class Flow : uint8_t { normal, break_, continue_ };

using Scope = std::unordered_map<std::string, Value>;

// While it lives, counts what the render on this thread creates and runs
// against its limits (detail::RenderBudget); renders do not nest.
class BudgetScope {
public:
  explicit BudgetScope(const RenderLimits& l) {
    b_.bytes_left = b_.max_bytes = l.max_bytes;
    b_.max_depth = l.max_depth;
    b_.steps_left = b_.max_steps = l.max_steps;
    b_.deadline = l.deadline;
    b_.cancel = l.cancel;
    saved_ = detail::current_budget();
    detail::current_budget() = &b_;
  }
  ~BudgetScope() { detail::current_budget() = saved_; }
  BudgetScope(const BudgetScope&) = delete;
  BudgetScope& operator=(const BudgetScope&) = delete;

private:
  detail::RenderBudget b_;
  detail::RenderBudget* saved_;
};

// Suspends the counting of created values until end() or the end of the scope.
class Uncharged {
public:
  Uncharged() : saved_(detail::current_budget()) { detail::current_budget() = nullptr; }
  ~Uncharged() { end(); }
  void end() const {
    if (saved_)
      detail::current_budget() = saved_;
  }
  Uncharged(const Uncharged&) = delete;
  Uncharged& operator=(const Uncharged&) = delete;

private:
  detail::RenderBudget* saved_;
};

class Interpreter {
public:
  Interpreter(const Object& globals, const RenderLimits& limits) : limits_(limits) {
    scopes_.emplace_back();
    auto& g = scopes_.back();
    install_globals(g);
    for (auto& [k, v] : globals.items)
      g[k] = v;
  }
  ~Interpreter() {
    // Namespaces are the one mutable kind, so the only way to a cycle of shared
    // references (`set ns.self = ns`): empty them all so that none outlives the render.
    for (auto& w : namespaces_)
      if (auto o = w.lock())
        Object().items.swap(o->items);
  }
  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;

  std::string run(const Node& root) {
    std::string out;
    exec_body(root.bodies[0], out);
    return out;
  }

  int line() const { return line_; }

private:
  [[noreturn]] static void fail(const std::string& what, int line) { throw TemplateError(what, line); }

  void install_globals(Scope& g) {
    g["raise_exception"] = Value::function("raise_exception", [this](const Args& a) -> Value {
      const Value* m = a.get(0, "message");
      throw TemplateError(m ? m->str() : std::string("raise_exception() was called"), line_,
                          TemplateError::Kind::raised);
    });
    // namespace(...) and dict(...): the dicts given and the keyword arguments.
    const auto object_of = [](const Args& a, bool ns) {
      Object o;
      o.is_namespace = ns;
      for (auto& p : a.positional)
        if (p.is_object())
          for (auto& [k, v] : p.object().items)
            o.set(k, v);
      for (auto& [k, v] : a.named)
        o.set(k, v);
      return Value(std::move(o));
    };
    g["namespace"] = Value::function("namespace", [this, object_of](const Args& a) {
      Value ns = object_of(a, true);
      namespaces_.push_back(ns.object_ptr());
      return ns;
    });
    g["dict"] = Value::function("dict", [object_of](const Args& a) { return object_of(a, false); });
    g["range"] = Value::function("range", [this](const Args& a) {
      int64_t start = 0, stop = 0, step = 1;
      const auto num = [this](const Value& v) {
        if (v.kind() != Value::Kind::integer)
          fail(std::string("range() takes integers, not ") + v.type_name(), line_);
        return v.as_int();
      };
      if (a.positional.size() == 1) {
        stop = num(a.positional[0]);
      } else if (a.positional.size() >= 2) {
        start = num(a.positional[0]);
        stop = num(a.positional[1]);
        if (a.positional.size() > 2)
          step = num(a.positional[2]);
      } else {
        fail("range() takes 1 to 3 arguments", line_);
      }
      if (step == 0)
        fail("range() step must not be zero", line_);
      // Building the list is work in proportion to its length: counted as steps
      // (and the deadline read) before it is built.
      const int64_t n = step > 0 ? (stop > start ? (stop - start + step - 1) / step : 0)
                                 : (start > stop ? (start - stop - step - 1) / -step : 0);
      if (n > max_range)
        fail("range() is too long", line_);
      detail::spend(static_cast<uint64_t>(n));
      detail::charge(static_cast<std::size_t>(n) * sizeof(Value));
      Array out;
      out.reserve(static_cast<std::size_t>(n));
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (static_cast<int64_t>(out.size()) >= max_range)
          fail("range() is too long", line_);
        out.push_back(Value(i));
      }
      return Value(std::move(out));
    });
    g["strftime_now"] = Value::function("strftime_now", [this](const Args& a) {
      const Value* f = a.get(0, "format");
      if (!f || !f->is_string())
        fail("strftime_now() takes a format string", line_);
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const std::size_t n = std::strftime(buf, sizeof buf, f->as_string().c_str(), &tm);
      return Value(std::string(buf, n));
    });
  }

  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it)
      if (auto f = it->find(name); f != it->end())
        return f->second;
    return Value();
  }

  void emit(std::string& out, const std::string& s) {
    if (out.size() + s.size() > limits_.max_output)
      throw TemplateError("the rendered prompt is larger than " + std::to_string(limits_.max_output >> 20) + " MiB",
                          line_, TemplateError::Limit::output);
    out += s;
  }

  Flow exec_body(const Body& body, std::string& out) {
    for (auto& n : body) {
      const Flow f = exec(*n, out);
      if (f != Flow::normal)
        return f;
    }
    return Flow::normal;
  }

  Flow exec(const Node& n, std::string& out) {
    line_ = n.line;
    detail::spend();
    switch (n.kind) {
    case Node::Kind::body:
      return exec_body(n.bodies[0], out);
    case Node::Kind::text:
      emit(out, n.text);
      return Flow::normal;
    case Node::Kind::output:
      emit(out, eval(*n.expr).str());
      return Flow::normal;
    case Node::Kind::if_:
      for (std::size_t i = 0; i < n.conds.size(); ++i)
        if (eval(*n.conds[i]).truthy())
          return exec_body(n.bodies[i], out);
      if (n.bodies.size() > n.conds.size())
        return exec_body(n.bodies.back(), out);
      return Flow::normal;
    case Node::Kind::for_:
      exec_for(n, out);
      return Flow::normal;
    case Node::Kind::set:
      exec_set(n);
      return Flow::normal;
    case Node::Kind::macro:
      define_macro(n);
      return Flow::normal;
    case Node::Kind::break_:
      if (loops_ == 0)
        fail("'break' outside a loop", n.line);
      return Flow::break_;
    case Node::Kind::continue_:
      if (loops_ == 0)
        fail("'continue' outside a loop", n.line);
      return Flow::continue_;
    case Node::Kind::filter_block: {
      std::string inner;
      const Flow f = exec_body(n.bodies[0], inner);
      scopes_.emplace_back();
      scopes_.back()["\x01input"] = Value(std::move(inner));
      const Value v = eval(*n.expr);
      scopes_.pop_back();
      emit(out, v.str());
      return f;
    }
    }
    return Flow::normal;
  }

  void exec_for(const Node& n, std::string& out) {
    const Value seq = eval(*n.expr);
    Array items;
    switch (seq.kind()) {
    case Value::Kind::array:
      items = seq.array();
      break;
    case Value::Kind::object:
      for (auto& [k, v] : seq.object().items)
        items.push_back(key_value(k));
      break;
    case Value::Kind::string:
      for (auto& c : utf8_chars(seq.as_string()))
        items.push_back(Value(c));
      break;
    case Value::Kind::undefined:
      break;
    default:
      fail(std::string("cannot loop over a ") + seq.type_name(), n.line);
    }
    scopes_.emplace_back();
    ++loops_;
    const auto bind = [&](const Value& item) {
      auto& s = scopes_.back();
      if (n.targets.size() == 1) {
        s[n.targets[0]] = item;
        return;
      }
      if (!item.is_array() || item.array().size() != n.targets.size())
        fail("cannot unpack " + item.repr() + " into " + std::to_string(n.targets.size()) + " names", n.line);
      for (std::size_t k = 0; k < n.targets.size(); ++k)
        s[n.targets[k]] = item.array()[k];
    };
    if (n.cond) { // the filter runs before the loop: loop.* count what passes
      Array kept;
      for (auto& item : items) {
        detail::spend();
        bind(item);
        if (eval(*n.cond).truthy())
          kept.push_back(item);
      }
      items = std::move(kept);
    }
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < len; ++i) {
      detail::spend();
      bind(items[static_cast<std::size_t>(i)]);
      // loop.* is a fixed handful of values per iteration, replaced by the next:
      // not counted against the budget of values the template creates.
      const Uncharged uncharged;
      Object loop;
      loop.set("index", Value(i + 1));
      loop.set("index0", Value(i));
      loop.set("revindex", Value(len - i));
      loop.set("revindex0", Value(len - i - 1));
      loop.set("first", Value(i == 0));
      loop.set("last", Value(i == len - 1));
      loop.set("length", Value(len));
      loop.set("depth", Value(int64_t{1}));
      loop.set("depth0", Value(int64_t{0}));
      loop.set("previtem", i > 0 ? items[static_cast<std::size_t>(i - 1)] : Value());
      loop.set("nextitem", i + 1 < len ? items[static_cast<std::size_t>(i + 1)] : Value());
      loop.set("cycle", Value::function("cycle", [i](const Args& a) {
                 return a.positional.empty() ? Value() : a.positional[static_cast<std::size_t>(i) % a.positional.size()];
               }));
      scopes_.back()["loop"] = Value(std::move(loop));
      uncharged.end();
      if (exec_body(n.bodies[0], out) == Flow::break_)
        break;
    }
    --loops_;
    scopes_.pop_back();
    if (len == 0 && n.bodies.size() > 1)
      exec_body(n.bodies[1], out);
  }

  void exec_set(const Node& n) {
    Value v;
    if (n.expr) {
      v = eval(*n.expr);
    } else {
      std::string inner;
      exec_body(n.bodies[0], inner);
      v = Value(std::move(inner));
    }
    if (!n.attr.empty()) {
      const Value ns = lookup(n.targets[0]);
      if (!ns.is_object() || !ns.object().is_namespace)
        fail("cannot set '" + n.attr + "' on '" + n.targets[0] + "', which is not a namespace()", n.line);
      ns.object().set(n.attr, std::move(v));
      return;
    }
    if (n.targets.size() == 1) {
      scopes_.back()[n.targets[0]] = std::move(v);
      return;
    }
    if (!v.is_array() || v.array().size() != n.targets.size())
      fail("cannot unpack " + v.repr() + " into " + std::to_string(n.targets.size()) + " names", n.line);
    for (std::size_t k = 0; k < n.targets.size(); ++k)
      scopes_.back()[n.targets[k]] = v.array()[k];
  }

  void define_macro(const Node& n) {
    const Node* def = &n;
    scopes_.back()[n.text] = Value::function(n.text, [this, def](const Args& a) {
      if (depth_ >= limits_.max_depth)
        throw TemplateError("macros nested deeper than " + std::to_string(limits_.max_depth), def->line,
                            TemplateError::Limit::recursion);
      if (a.positional.size() > def->params.size())
        fail("macro '" + def->text + "' takes " + std::to_string(def->params.size()) + " arguments", def->line);
      Scope frame;
      for (std::size_t k = 0; k < def->params.size(); ++k) {
        const auto& [name, dflt] = def->params[k];
        const Value* given = a.get(k, name.c_str());
        frame[name] = given ? *given : dflt ? eval(*dflt) : Value();
      }
      std::vector<Scope> saved;
      saved.swap(scopes_);
      scopes_.push_back(saved.front());
      scopes_.push_back(std::move(frame));
      ++depth_;
      const int saved_loops = loops_;
      loops_ = 0;
      std::string out;
      try {
        exec_body(def->bodies[0], out);
      } catch (...) {
        scopes_.swap(saved);
        --depth_;
        loops_ = saved_loops;
        throw;
      }
      // The macro may have defined names at its top: those stay inside it.
      scopes_.swap(saved);
      --depth_;
      loops_ = saved_loops;
      return Value(std::move(out));
    });
  }

  Value eval(const Expr& e) {
    line_ = e.line;
    detail::spend();
    switch (e.kind) {
    case Expr::Kind::literal:
      return e.value;
    case Expr::Kind::name:
      return lookup(e.name);
    case Expr::Kind::list:
    case Expr::Kind::tuple: {
      Array a;
      for (auto& x : e.args)
        a.push_back(eval(*x));
      return Value(std::move(a));
    }
    case Expr::Kind::dict: {
      Object o;
      for (std::size_t k = 0; k + 1 < e.args.size(); k += 2) {
        const Value key = eval(*e.args[k]);
        if (!key.is_string() && key.kind() != Value::Kind::integer)
          fail(std::string("dict keys must be strings or integers, not ") + key.type_name(), e.line);
        o.set(key.is_string() ? dict_key(key.as_string()) : dict_key(key.as_int()), eval(*e.args[k + 1]));
      }
      return Value(std::move(o));
    }
    case Expr::Kind::attr: {
      const Value obj = eval(*e.args[0]);
      return get_attr(obj, e.name, e.line, describe(*e.args[0]));
    }
    case Expr::Kind::index: {
      const Value obj = eval(*e.args[0]);
      const Value key = eval(*e.args[1]);
      return get_item(obj, key, e.line, describe(*e.args[0]));
    }
    case Expr::Kind::slice: {
      const Value obj = eval(*e.args[0]);
      std::optional<int64_t> part[3];
      for (int k = 0; k < 3; ++k)
        if (e.args[1 + k]) {
          const Value v = eval(*e.args[1 + k]);
          if (v.is_none())
            continue;
          if (v.kind() != Value::Kind::integer)
            fail("slice indices must be integers", e.line);
          part[k] = v.as_int();
        }
      return slice(obj, part[0], part[1], part[2], e.line);
    }
    case Expr::Kind::call:
      return call(e);
    case Expr::Kind::filter: {
      Value in = eval(*e.args[0]);
      Args a = args_of(e, 1);
      line_ = e.line;
      return apply_filter(e.name, in, a, e.line);
    }
    case Expr::Kind::test: {
      Value in = eval(*e.args[0]);
      Args a = args_of(e, 1);
      const bool r = apply_test(e.name, in, a, e.line);
      return Value(e.negate ? !r : r);
    }
    case Expr::Kind::unary: {
      const Value v = eval(*e.args[0]);
      if (e.name == "not")
        return Value(!v.truthy());
      if (v.kind() == Value::Kind::integer)
        return e.name == "-" ? Value(-v.as_int()) : v;
      if (v.kind() == Value::Kind::real)
        return e.name == "-" ? Value(-v.as_double()) : v;
      fail("bad operand type for unary " + e.name + ": " + v.type_name(), e.line);
    }
    case Expr::Kind::binary:
      return binary(e);
    case Expr::Kind::cond:
      if (eval(*e.args[0]).truthy())
        return eval(*e.args[1]);
      return e.args[2] ? eval(*e.args[2]) : Value();
    }
    return Value();
  }

  static std::string describe(const Expr& e) {
    if (e.kind == Expr::Kind::name)
      return "'" + e.name + "'";
    if (e.kind == Expr::Kind::attr)
      return describe(*e.args[0]) + "." + e.name;
    return "the value";
  }

  Args args_of(const Expr& e, std::size_t from) {
    Args a;
    for (std::size_t k = from; k < e.args.size(); ++k)
      a.positional.push_back(eval(*e.args[k]));
    for (auto& [name, x] : e.kwargs)
      a.named.emplace_back(name, eval(*x));
    return a;
  }

  Value call(const Expr& e) {
    const Expr& callee = *e.args[0];
    if (callee.kind == Expr::Kind::attr) {
      const Value obj = eval(*callee.args[0]);
      Args a = args_of(e, 1);
      line_ = e.line;
      if (auto r = call_method(obj, callee.name, a, e.line))
        return *r;
      const Value f = get_attr(obj, callee.name, e.line, describe(*callee.args[0]));
      if (!f.is_callable())
        fail(describe(callee) + " (a " + f.type_name() + ") is not callable", e.line);
      return f.fn()(a);
    }
    const Value f = eval(callee);
    if (!f.is_callable()) {
      if (f.is_undefined() && callee.kind == Expr::Kind::name)
        fail("unknown function '" + callee.name + "'", e.line);
      fail(describe(callee) + " (a " + std::string(f.type_name()) + ") is not callable", e.line);
    }
    Args a = args_of(e, 1);
    line_ = e.line;
    return f.fn()(a);
  }

  Value binary(const Expr& e) {
    const std::string& op = e.name;
    if (op == "and") {
      Value l = eval(*e.args[0]);
      return l.truthy() ? eval(*e.args[1]) : l;
    }
    if (op == "or") {
      Value l = eval(*e.args[0]);
      return l.truthy() ? l : eval(*e.args[1]);
    }
    const Value l = eval(*e.args[0]);
    const Value r = eval(*e.args[1]);
    line_ = e.line;
    if (op == "==")
      return Value(l == r);
    if (op == "!=")
      return Value(!(l == r));
    if (op == "~")
      return Value(l.str() + r.str());
    if (op == "in" || op == "not in") {
      const bool in = contains(r, l, e.line);
      return Value(op == "in" ? in : !in);
    }
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      int c = 0;
      if (l.is_number() && r.is_number())
        c = l.as_double() < r.as_double() ? -1 : l.as_double() > r.as_double() ? 1 : 0;
      else if (l.is_string() && r.is_string())
        c = l.as_string().compare(r.as_string());
      else
        fail(std::string("cannot compare ") + l.type_name() + " and " + r.type_name() + " with " + op, e.line);
      return Value(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
    }
    if (op == "+") {
      if (l.is_string() && r.is_string())
        return Value(l.as_string() + r.as_string());
      if (l.is_array() && r.is_array()) {
        Array a = l.array();
        a.insert(a.end(), r.array().begin(), r.array().end());
        return Value(std::move(a));
      }
    }
    if (op == "*") {
      const Value* s = l.is_string() || l.is_array() ? &l : r.is_string() || r.is_array() ? &r : nullptr;
      const Value* n = s == &l ? &r : &l;
      if (s && n->kind() == Value::Kind::integer) {
        const int64_t times = std::max<int64_t>(0, n->as_int());
        if (s->is_string()) {
          if (static_cast<uint64_t>(times) * s->as_string().size() > limits_.max_output)
            throw TemplateError("string repetition is longer than the output limit", e.line,
                                TemplateError::Limit::output);
          detail::charge(static_cast<std::size_t>(times) * s->as_string().size());
          std::string out;
          for (int64_t k = 0; k < times; ++k)
            out += s->as_string();
          return Value(std::move(out));
        }
        if (static_cast<uint64_t>(times) * s->array().size() > static_cast<uint64_t>(max_range))
          fail("list repetition is too long", e.line);
        Array out;
        for (int64_t k = 0; k < times; ++k)
          out.insert(out.end(), s->array().begin(), s->array().end());
        return Value(std::move(out));
      }
    }
    if (l.is_number() && r.is_number()) {
      const bool ints = l.kind() == Value::Kind::integer && r.kind() == Value::Kind::integer;
      const double a = l.as_double(), b = r.as_double();
      if (op == "+")
        return ints ? Value(l.as_int() + r.as_int()) : Value(a + b);
      if (op == "-")
        return ints ? Value(l.as_int() - r.as_int()) : Value(a - b);
      if (op == "*")
        return ints ? Value(l.as_int() * r.as_int()) : Value(a * b);
      if (op == "/") {
        if (b == 0)
          fail("division by zero", e.line);
        return Value(a / b);
      }
      if (op == "//" || op == "%") {
        if (b == 0)
          fail("division by zero", e.line);
        if (ints) {
          const int64_t x = l.as_int(), y = r.as_int();
          int64_t q = x / y, m = x % y;
          if (m != 0 && ((m < 0) != (y < 0))) { // Python floors
            --q;
            m += y;
          }
          return op == "//" ? Value(q) : Value(m);
        }
        const double q = std::floor(a / b);
        return op == "//" ? Value(q) : Value(a - q * b);
      }
      if (op == "**")
        return ints && r.as_int() >= 0 ? Value(static_cast<int64_t>(std::llround(std::pow(a, b)))) : Value(std::pow(a, b));
    }
    if (l.is_undefined() || r.is_undefined())
      fail(describe(*(l.is_undefined() ? e.args[0] : e.args[1])) + " is undefined", e.line);
    fail(std::string("unsupported operand types for ") + op + ": " + l.type_name() + " and " + r.type_name(), e.line);
  }

  RenderLimits limits_;
  std::vector<Scope> scopes_;
  std::vector<std::weak_ptr<Object>> namespaces_; // every namespace() of this render
  int loops_ = 0;
  int depth_ = 0;
  int line_ = 0;
};

} // namespace

std::string Template::render(const Object& globals, const RenderLimits& limits) const {
  const BudgetScope budget(limits);
  Interpreter in(globals, limits);
  try {
    return in.run(*root_);
  } catch (const TemplateError& e) {
    if (e.line() == 0 && e.limit() != TemplateError::Limit::none) // thrown where the line is not known
      throw TemplateError(e.message(), in.line(), e.limit());
    throw;
  }
}

} // namespace strata::model::jinja
