package dev.fenced.client;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/** The little JSON the API needs, without a dependency: objects, arrays, strings, numbers
 * (as Double or Long), booleans, null. */
final class Json {
    private final String s;
    private int i;
    private int depth; // (bounded: a hostile answer nested 100,000 deep overflowed the stack)
    private static final int MAX_DEPTH = 64;

    private Json(String s) {
        this.s = s;
    }

    /** Parses an object; anything else (or malformed text) is null. */
    @SuppressWarnings("unchecked")
    static Map<String, Object> parseObject(String text) {
        try {
            Json p = new Json(text);
            Object v = p.value();
            p.ws();
            if (p.i != p.s.length() || !(v instanceof Map)) return null;
            return (Map<String, Object>) v;
        } catch (RuntimeException e) {
            return null;
        }
    }

    static String quote(String v) {
        StringBuilder b = new StringBuilder("\"");
        for (char c : v.toCharArray()) {
            switch (c) {
                case '"' -> b.append("\\\"");
                case '\\' -> b.append("\\\\");
                case '\n' -> b.append("\\n");
                case '\r' -> b.append("\\r");
                case '\t' -> b.append("\\t");
                default -> {
                    if (c < 0x20) b.append(String.format("\\u%04x", (int) c));
                    else b.append(c);
                }
            }
        }
        return b.append('"').toString();
    }

    /** An object of string keys and String, Number, Boolean or null values. */
    static String object(Map<String, Object> fields) {
        StringBuilder b = new StringBuilder("{");
        for (Map.Entry<String, Object> e : fields.entrySet()) {
            if (b.length() > 1) b.append(',');
            b.append(quote(e.getKey())).append(':');
            Object v = e.getValue();
            if (v == null) b.append("null");
            else if (v instanceof String str) b.append(quote(str));
            else if (v instanceof Double d) b.append(d.isInfinite() || d.isNaN() ? "null" : d.toString());
            else b.append(v);
        }
        return b.append('}').toString();
    }

    private void ws() {
        while (i < s.length() && Character.isWhitespace(s.charAt(i))) i++;
    }

    private Object value() {
        if (++depth > MAX_DEPTH) throw new IllegalArgumentException("nested too deep");
        try {
            return value1();
        } finally {
            depth--;
        }
    }

    private Object value1() {
        ws();
        char c = s.charAt(i);
        if (c == '{') {
            i++;
            Map<String, Object> m = new LinkedHashMap<>();
            ws();
            if (s.charAt(i) == '}') {
                i++;
                return m;
            }
            for (;;) {
                ws();
                String k = string();
                ws();
                expect(':');
                m.put(k, value());
                ws();
                if (s.charAt(i) == ',') {
                    i++;
                    continue;
                }
                expect('}');
                return m;
            }
        }
        if (c == '[') {
            i++;
            List<Object> l = new ArrayList<>();
            ws();
            if (s.charAt(i) == ']') {
                i++;
                return l;
            }
            for (;;) {
                l.add(value());
                ws();
                if (s.charAt(i) == ',') {
                    i++;
                    continue;
                }
                expect(']');
                return l;
            }
        }
        if (c == '"') return string();
        if (s.startsWith("true", i)) {
            i += 4;
            return Boolean.TRUE;
        }
        if (s.startsWith("false", i)) {
            i += 5;
            return Boolean.FALSE;
        }
        if (s.startsWith("null", i)) {
            i += 4;
            return null;
        }
        int start = i;
        while (i < s.length() && "+-0123456789.eE".indexOf(s.charAt(i)) >= 0) i++;
        String num = s.substring(start, i);
        if (num.isEmpty()) throw new IllegalArgumentException("not JSON");
        if (num.matches("-?[0-9]+")) {
            try {
                return Long.parseLong(num);
            } catch (NumberFormatException e) {
                return Double.parseDouble(num);
            }
        }
        return Double.parseDouble(num);
    }

    private void expect(char c) {
        if (s.charAt(i) != c) throw new IllegalArgumentException("not JSON");
        i++;
    }

    private String string() {
        expect('"');
        StringBuilder b = new StringBuilder();
        for (;;) {
            char c = s.charAt(i++);
            if (c == '"') return b.toString();
            if (c != '\\') {
                b.append(c);
                continue;
            }
            char e = s.charAt(i++);
            switch (e) {
                case 'n' -> b.append('\n');
                case 't' -> b.append('\t');
                case 'r' -> b.append('\r');
                case 'b' -> b.append('\b');
                case 'f' -> b.append('\f');
                case 'u' -> {
                    b.append((char) Integer.parseInt(s.substring(i, i + 4), 16));
                    i += 4;
                }
                default -> b.append(e);
            }
        }
    }
}
