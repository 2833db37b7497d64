// examples/llama:chat_template: the Jinja subset's errors (each names the
// origin, the line and what is wrong or what is supported), where a Hugging
// Face directory keeps its template, and, as a mode the Python oracle test
// drives (chat_template_python_test.sh):
//   chat_template_test render DIR CONVERSATIONS OUT
//     every conversation of CONVERSATIONS (a JSON array of message arrays)
//     rendered with DIR's template, without and with the generation prompt,
//     and the ids of each text through DIR's tokenizer.json, into OUT (JSON:
//     [{"text" or "error", "ids"}, ...] in that order).
#include "examples/llama/chat_template.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "base/errors.h"
#include "examples/llama/tokenizer.h"

namespace shardtrain::examples::llama {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

std::string Apply(const std::string& source, const Json& messages, bool gen = false,
                  std::map<std::string, std::string> special = {{"bos_token", "<s>"}, {"eos_token", "</s>"}}) {
  return ChatTemplate(source, "t.jinja", std::move(special)).Apply(messages, gen);
}

// The message an InvalidArgumentError carries, "" when none is thrown.
template <typename F>
std::string ErrorOf(F f) {
  try {
    f();
  } catch (const InvalidArgumentError& e) {
    return e.what();
  }
  return "";
}

const Json kChat = Json::parse(R"([{"role": "system", "content": " Be brief. "},
  {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])");

TEST(ChatTemplate, RendersWithJinjaWhitespaceRules) {
  // trim_blocks drops the newline after a block tag, lstrip_blocks the
  // indentation before it; `-` strips all whitespace on its side.
  const std::string t =
      "{{ bos_token }}\n{% for m in messages %}\n  {% if m.role == 'system' %}\n[{{ m.content | trim }}]\n"
      "  {%- else %}\n<{{ m.role }}>{{ m.content }}{{ eos_token if m.role == 'assistant' }}\n  {% endif %}\n"
      "{% endfor %}\n{% if add_generation_prompt %}<assistant>{% endif %}";
  EXPECT_EQ(Apply(t, kChat), "<s>\n[Be brief.]<user>Hi\n<assistant>Hello!</s>\n");
  EXPECT_EQ(Apply(t, Json::array({kChat[1]}), true), "<s>\n<user>Hi\n<assistant>");
}

TEST(ChatTemplate, ScopesNamespacesAndLoopControls) {
  const std::string t =
      "{% set ns = namespace(n=0) %}{% set x = 'outer' %}{% for m in messages %}{% set x = m.role %}"
      "{% set ns.n = ns.n + 1 %}{% if loop.index0 == 1 %}{% break %}{% endif %}{% endfor %}"
      "{{ x }} {{ ns.n }} {{ messages | map(attribute='role') | join(',') }} {{ messages[1:] | length }}";
  EXPECT_EQ(Apply(t, kChat), "outer 2 system,user,assistant 2");
}

TEST(ChatTemplate, RaiseExceptionNamesTheTemplateAndLine) {
  const std::string t =
      "{% for m in messages %}\n{% if m.role == 'system' %}\n"
      "{{ raise_exception('System messages are not supported') }}\n{% endif %}{% endfor %}";
  const std::string e = ErrorOf([&] { Apply(t, kChat); });
  EXPECT_NE(e.find("t.jinja: line 3: the chat template raised an exception: System messages are not supported"),
            std::string::npos)
      << e;
}

TEST(ChatTemplate, RefusesWhatItDoesNotSupportByName) {
  auto parse_error = [](const std::string& t) { return ErrorOf([&] { Apply(t, kChat); }); };
  EXPECT_NE(parse_error("a\n{% macro m() %}x{% endmacro %}").find("t.jinja: line 2: {% macro %} is not supported"),
            std::string::npos);
  EXPECT_NE(parse_error("{{ x | wordwrap }}").find("filter 'wordwrap' is not supported (supported: abs,"),
            std::string::npos);
  EXPECT_NE(parse_error("{{ x is escaped }}").find("test 'escaped' is not supported"), std::string::npos);
  EXPECT_NE(parse_error("{% if x %}").find("missing {% endif %}"), std::string::npos);
  EXPECT_NE(parse_error("{% endfor %}").find("unexpected {% endfor %}"), std::string::npos);
  EXPECT_NE(parse_error("\n\n{{ 'a' ").find("line 3: a tag is never closed"), std::string::npos);
  EXPECT_NE(parse_error("{{ foo.bar }}").find("line 1: 'foo' is undefined"), std::string::npos);
  EXPECT_NE(parse_error("{% set x = 1 %}{% set x.y = 2 %}").find("only a namespace() takes"), std::string::npos);
  EXPECT_NE(parse_error("{{ messages[0].content.frobnicate() }}").find("str has no method 'frobnicate'"),
            std::string::npos);
  EXPECT_NE(parse_error("{{ 1 // 0 }}").find("integer division or modulo by zero"), std::string::npos);
  // Integers are 64-bit here (Python's are unbounded): past them is an error, never a wrapped value.
  EXPECT_NE(parse_error("{{ 9223372036854775807 + 1 }}").find("is past the 64-bit integers"), std::string::npos);
  EXPECT_NE(parse_error("{{ 3 ** 1000000000000 }}").find("is past the 64-bit integers"), std::string::npos);
  EXPECT_NE(parse_error("{{ -9223372036854775807 - 2 }}").find("is past the 64-bit integers"), std::string::npos);
  EXPECT_NE(parse_error("{{ '1e300' | int }}").find("is past the 64-bit integers"), std::string::npos);
  EXPECT_NE(parse_error("{{ range() }}").find("range() takes 1 to 3 integers, not 0"), std::string::npos);
  EXPECT_NE(parse_error("{{ '\\u12g4' }}").find("a truncated \\u escape"), std::string::npos);
  EXPECT_NE(parse_error("{{ '\\U00110000' }}").find("is not a Unicode scalar value"), std::string::npos);
  EXPECT_EQ(Apply("{{ range(9223372036854775805, 9223372036854775807, 5) | list }} {{ '\\U0001F600\\x41' }}", kChat),
            "[9223372036854775805] \xF0\x9F\x98\x80"
            "A");
  EXPECT_EQ(Apply("{{ 2 ** 62 }} {{ 1e999 }} {{ -1e999 }} {{ 1 ** 1000000000000 }}", kChat),
            "4611686018427387904 inf -inf 1");
  // Bounds that keep a hostile template from exhausting the stack, the memory or the time.
  EXPECT_NE(
      parse_error("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}").find("nested deeper than 100"),
      std::string::npos);
  std::string chain = "{{ 1";
  for (int k = 0; k < 5000; ++k) chain += " + 1";
  EXPECT_NE(parse_error(chain + " }}").find("an expression nested deeper than 100 levels"), std::string::npos);
  std::string ifs;
  for (int k = 0; k < 500; ++k) ifs += "{% if true %}";
  EXPECT_NE(parse_error(ifs).find("nested deeper than 100"), std::string::npos);
  EXPECT_NE(parse_error("{% for i in range(10**9) %}{% endfor %}").find("range() of more than 1000000 items"),
            std::string::npos);
  EXPECT_NE(parse_error("{% set s = namespace(t='ab') %}{% for i in range(40) %}{% set s.t = s.t ~ s.t %}{% endfor %}")
                .find("builds a value over the bounds"),
            std::string::npos);
  EXPECT_NE(parse_error("{% for i in range(100000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}{{ 1 }}")
                .find("runs over"),
            std::string::npos);
}

TEST(ChatTemplate, LoadsFromAHuggingFaceDirectory) {
  const fs::path dir = fs::path(::testing::TempDir()) / "chat_dir";
  fs::remove_all(dir);
  fs::create_directories(dir);
  EXPECT_FALSE(LoadChatTemplate(dir.string()).has_value());
  const Json config = {
      {"bos_token", {{"content", "<B>"}}}, {"eos_token", "<E>"}, {"chat_template", "C{{ bos_token }}"}};
  std::ofstream(dir / "tokenizer_config.json") << config.dump();
  EXPECT_EQ(LoadChatTemplate(dir.string())->Apply(kChat, false), "C<B>");
  Json named = config;
  named["chat_template"] = Json::parse(R"([{"name": "tool_use", "template": "T"}, {"name": "default",
                                           "template": "D{{ eos_token }}"}])");
  std::ofstream(dir / "tokenizer_config.json") << named.dump();
  EXPECT_EQ(LoadChatTemplate(dir.string())->Apply(kChat, false), "D<E>");
  named["chat_template"].erase(1);
  std::ofstream(dir / "tokenizer_config.json") << named.dump();
  EXPECT_NE(ErrorOf([&] { LoadChatTemplate(dir.string()); }).find("names templates (tool_use) but none is \"default\""),
            std::string::npos);
  std::ofstream(dir / "chat_template.jinja") << "J{{ messages | length }}";  // the newer place wins
  EXPECT_EQ(LoadChatTemplate(dir.string())->Apply(kChat, false), "J3");
}

// The render mode of the Python oracle test.
int Render(const std::string& dir, const std::string& conversations_path, const std::string& out_path) {
  const std::optional<ChatTemplate> chat = LoadChatTemplate(dir);
  if (!chat) throw InvalidArgumentError(dir + " has no chat template");
  const auto tok = LoadTokenizer((fs::path(dir) / "tokenizer.json").string());
  std::ifstream in(conversations_path);
  const Json conversations = Json::parse(in);
  Json out = Json::array();
  for (const Json& messages : conversations) {
    for (const bool gen : {false, true}) {
      Json r = Json::object();
      try {
        const std::string text = chat->Apply(messages, gen);
        r["text"] = text;
        r["ids"] = tok->Encode(text);
      } catch (const InvalidArgumentError& e) {
        r["error"] = e.what();
      }
      out.push_back(r);
    }
  }
  std::ofstream(out_path) << out.dump(1);
  return 0;
}

}  // namespace
}  // namespace shardtrain::examples::llama

int main(int argc, char** argv) {
  if (argc == 5 && std::strcmp(argv[1], "render") == 0) {
    try {
      return shardtrain::examples::llama::Render(argv[2], argv[3], argv[4]);
    } catch (const std::exception& e) {
      std::cerr << "chat_template_test render: " << e.what() << "\n";
      return 1;
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
